"""Machine constants, measured: python -m minitrain.plan calibrate [--out PATH] [--ranks 2 4].

What the time model needs, each measured the way the jobs run it:
* matmul FLOP rate by size and dtype (square n x n x n, best of a few; CPU: at 1 BLAS thread and at
  every core, as a job of 1 rank uses them all and a job of N ranks caps each at cores / N);
* elementwise seconds per element (simple arithmetic, transcendental, reduction along an axis) and the
  Python overhead of one NumPy call, of one autograd node (forward + backward of a trivial op), per
  parameter of an optimizer step and of DDP's hooks, of one collective call and one traced span, and
  the cost of first touching new memory (arrays a forward keeps for backward);
* latency alpha and inverse bandwidth beta of point-to-point messages and of each collective algorithm
  (minitrain's own, under mpiexec -n p), fitted to t = steps·alpha + bytes·beta with the algorithm's
  own step and byte counts (comm/collectives.py's cost table).
With MINITRAIN_DEVICE=cuda the matmuls, elementwise ops and collectives run on CuPy arrays.
The result is JSON at ~/.cache/minitrain/machine.json (what plan uses by default); the
committed machines/cpu-2core.json was measured so on the 2-core CI machine, machines/a100-80gb.json
is NVIDIA's datasheet (not measured).
"""
import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np

MACHINES = pathlib.Path(__file__).parent / "machines"
DEFAULT_PATH = pathlib.Path(os.environ.get("MINITRAIN_CACHE", pathlib.Path.home() / ".cache" / "minitrain")) / "machine.json"
DTYPES = ("float32", "float64", "float16", "bfloat16")
# steps and bytes per rank of each algorithm (p ranks, N bytes): comm/collectives.py's table
COLLECTIVES = {
    "p2p": lambda p, n: (1, n),
    "ring_all_reduce": lambda p, n: (2 * (p - 1), 2 * (p - 1) / p * n),
    "ring_reduce_scatter": lambda p, n: (p - 1, (p - 1) / p * n),
    "ring_all_gather": lambda p, n: (p - 1, (p - 1) / p * n),
    "broadcast": lambda p, n: (math.ceil(math.log2(p)), math.ceil(math.log2(p)) * n),
}


def load_machine(name=None):
    """A machine's constants: a path, a committed name (``cpu-2core``, ``a100-80gb``), or by default the
    calibration at ~/.cache/minitrain/machine.json if there is one, else ``cpu-2core``."""
    if name is None:
        name = str(DEFAULT_PATH) if DEFAULT_PATH.exists() else "cpu-2core"
    path = pathlib.Path(name)
    if not path.exists():
        path = MACHINES / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in MACHINES.glob("*.json"))
        raise FileNotFoundError(f"no machine {name!r}: give a JSON path or one of {known} "
                                f"(python -m minitrain.plan calibrate writes {DEFAULT_PATH})")
    with open(path) as f:
        return json.load(f)


def _xp():
    from .. import backend
    return backend.xp(), backend.synchronize


def _best(fn, repeats, sync):
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _dtype(name):
    from ..backend import bfloat16
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def measure_matmul(dtype, sizes, repeats=5):
    """[[n, FLOP/s]] for n x n @ n x n."""
    xp, sync = _xp()
    out = []
    for n in sizes:
        a = xp.asarray(np.random.default_rng(0).random((n, n))).astype(_dtype(dtype))
        b = xp.asarray(np.random.default_rng(1).random((n, n))).astype(_dtype(dtype))
        slow = dtype == "float16" and xp is np and n >= 64        # no BLAS for fp16 on NumPy
        out.append([n, 2 * n ** 3 / _best(lambda: a @ b, 1 if slow else repeats, sync)])
    return out


def measure_elementwise(dtype, n=1 << 18, repeats=10):
    """Seconds per element of the kinds of elementwise work a step does: ``simple`` (a + b, a new
    array), ``inplace`` (a += b), ``transcendental`` (tanh, exp), ``reduce`` (a sum along the last axis) and ``scatter``
    (an embedding's backward: rows added at repeated indices)."""
    xp, sync = _xp()
    a = xp.asarray(np.random.default_rng(0).random(n)).astype(_dtype(dtype))
    b = xp.asarray(np.random.default_rng(1).random(n)).astype(_dtype(dtype))
    rows = a.reshape(-1, 64)
    from ..backend import scatter_add
    table = xp.zeros((97, 64), a.dtype)
    index = xp.asarray(np.random.default_rng(2).integers(0, 97, n // 64))
    return {"simple": _best(lambda: a + b, repeats, sync) / n,
            "inplace": _best(lambda: a.__iadd__(b), repeats, sync) / n,
            "transcendental": _best(lambda: xp.tanh(a), repeats, sync) / n,
            "reduce": _best(lambda: rows.sum(axis=-1, keepdims=True), repeats, sync) / n,
            "scatter": _best(lambda: scatter_add(table, index, rows), 3, sync) / n}


def measure_fresh_memory(n=1 << 16, arrays=16, repeats=5):
    """Seconds per byte of first touching new memory: making arrays that stay alive (what forward does
    with the activations it saves) minus making as many that are freed at once (which reuse the same
    pages). On a virtual machine each new page costs a fault, often more than the arithmetic."""
    xp, sync = _xp()
    a = xp.ones(n, np.float32)

    def kept():
        return [a + 1.0 for _ in range(arrays)]

    def freed():
        for _ in range(arrays):
            a + 1.0
    return max(0.0, (_best(kept, repeats, sync) - _best(freed, repeats, sync)) / (arrays * a.nbytes))


def measure_overheads(repeats=5):
    """Python's share of a step, measured on tiny arrays: one NumPy call; one autograd node (forward +
    backward of x * 1.0); per parameter tensor, an Adam step and DDP's hook and write-back (on a
    one-rank ThreadWorld); one collective call that moves nothing; one traced span; one action of a
    pipeline (its runtime's bookkeeping and a backward call per micro-batch, beyond the layers' work)."""
    xp, sync = _xp()
    from .. import Tensor, nn, optim, trace
    from ..comm import ThreadWorld, ring_all_reduce
    a, b = xp.ones(4, np.float32), xp.ones(4, np.float32)

    def calls():
        for _ in range(1000):
            a.__iadd__(b)
    numpy_call = _best(calls, repeats, sync) / 1000
    chain = 200

    def nodes():
        x = Tensor(xp.ones(4, np.float32), requires_grad=True)
        y = x
        for _ in range(chain):
            y = y * 1.0
        y.sum().backward()
    node = _best(nodes, repeats, sync) / chain
    k = 64
    params = [nn.Parameter(xp.ones(1, np.float32)) for _ in range(k)]
    for q in params:
        q.grad = xp.ones(1, np.float32)
    adam = optim.Adam(params, lr=1e-3)
    optimizer_param = _best(adam.step, repeats, sync) / k

    def ddp_and_collective(comm):
        from ..parallel import DistributedDataParallel
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(k // 2)])
        x = Tensor(xp.ones((1, 1), np.float32))
        plain = _best(lambda: model(x).sum().backward(), repeats, sync)
        ddp = DistributedDataParallel(model, comm)
        wrapped = _best(lambda: ddp(x).sum().backward(), repeats, sync)
        one = xp.ones(1, np.float32)
        call = _best(lambda: [ring_all_reduce(comm, one) for _ in range(100)], repeats, sync) / 100
        from ..nn import functional as F
        from ..parallel.pipeline import PipelineParallel
        m, tiny = 8, nn.Sequential(nn.Linear(1, 1))        # a pipeline of one stage: its actions' own cost
        pipe = PipelineParallel(tiny, comm, "1f1b", num_microbatches=m)
        xs, ys = xp.ones((m, 1), np.float32), xp.zeros(m, np.int64)
        loss = (lambda out, y: F.mse_loss(out, out * 0.0))  # noqa: E731
        piped = _best(lambda: pipe.train_step(xs, ys, loss), repeats, sync)

        def direct():
            for i in range(m):
                (F.mse_loss(tiny(Tensor(xs[i:i + 1])), tiny(Tensor(xs[i:i + 1])) * 0.0) * (1.0 / m)).backward()
        action = max(0.0, piped - _best(direct, repeats, sync)) / (2 * m)
        return max(0.0, wrapped - plain) / k, call, action
    ddp_param, collective_call, pipeline_action = ThreadWorld(1).run(ddp_and_collective)[0]
    trace.enable(rank=0)

    def spans():
        for _ in range(200):
            with trace.span("x"):
                pass
    span = _best(spans, repeats, sync) / 200
    trace.disable()
    trace.tracer().events.clear()
    return {"numpy_call_s": numpy_call, "autograd_node_s": node, "optimizer_param_s": optimizer_param,
            "ddp_param_s": ddp_param, "collective_call_s": collective_call, "trace_span_s": span,
            "pipeline_action_s": pipeline_action}


def fit_alpha_beta(points, name, p):
    """Least squares of t = steps·alpha + bytes·beta over [(nbytes, seconds)], in relative error (each
    point weighted by 1/t, so that small messages count as much as large ones); both kept >= 0."""
    rows = [COLLECTIVES[name](p, n) for n, _ in points]
    a = np.array(rows, np.float64)
    t = np.array([s for _, s in points], np.float64)
    (alpha, beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    if beta <= 0:
        alpha, beta = float(np.min(t / a[:, 0])), 1e-12
    if alpha <= 0:
        alpha, beta = 1e-7, float(np.median(t / a[:, 1]))
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "points": [[int(n), float(s)] for n, s in points]}


def _worker(out_path, sizes):
    """Under mpiexec: time every collective at every size (median of 5, slowest rank); rank 0 writes JSON."""
    from .. import backend, comm as mtcomm
    c = mtcomm.init()
    xp, sync = backend.xp(), backend.synchronize
    results = {}
    for name in COLLECTIVES:
        points = []
        for nbytes in sizes:
            x = xp.ones(nbytes // 4, np.float32)
            buf = xp.empty_like(x)
            if name == "p2p":
                if c.size < 2:
                    break

                def op():
                    if c.rank == 0:
                        c.send(x, 1, tag=7)
                    elif c.rank == 1:
                        c.recv(buf, 0, tag=7)
            else:
                fn = {"ring_all_reduce": lambda: mtcomm.ring_all_reduce(c, x),
                      "ring_reduce_scatter": lambda: mtcomm.ring_reduce_scatter(c, x),
                      "ring_all_gather": lambda: mtcomm.ring_all_gather(c, x[:x.size // c.size], total=x.size // c.size * c.size),
                      "broadcast": lambda: mtcomm.broadcast(c, buf, root=0)}[name]
                op = fn
            times = []
            for _ in range(9):
                c.barrier()
                t = time.perf_counter()
                op()
                sync()
                times.append(time.perf_counter() - t)
            mine = np.array([min(times[1:])])                  # best of 8, as the other constants
            slowest = mtcomm.all_reduce(c, mine, op="max")[0]
            points.append((nbytes, float(slowest)))
        if points and c.rank == 0:
            results[name] = fit_alpha_beta(points, name, c.size)
    if c.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def calibrate(ranks=(2, 4), quick=False, log=print):
    """Measure this machine (see the module docstring); returns the JSON-ready dict."""
    from .. import backend
    from ..testing import run_mpi
    device = backend.get_device()
    cores = os.cpu_count() or 1
    sizes = [16, 32, 64, 128, 256, 512] + ([] if quick else [1024])
    machine = {"name": f"{platform.node() or 'this machine'} ({device})", "device": device, "cores": cores,
               "memory_bytes": _memory_bytes(), "measured": time.strftime("%Y-%m-%d %H:%M"),
               "numpy": np.__version__, "python": platform.python_version(), "matmul_flops": {}}
    # first, while malloc has freed no large array yet: once one has been, small ones are recycled from the
    # heap and never fault, which is not the state of a job whose backward hands its activations back
    fresh = float(np.median([measure_fresh_memory() for _ in range(5)]))
    threads = [1, cores] if device == "cpu" and cores > 1 else [1]
    for dtype in DTYPES:
        machine["matmul_flops"][dtype] = {}
        for th in threads:
            with _blas_threads(th):
                machine["matmul_flops"][dtype][str(th)] = measure_matmul(
                    dtype, [n for n in sizes if dtype != "float16" or device != "cpu" or n <= 128],
                    repeats=3 if quick else 5)
            log(f"matmul {dtype} x{th} threads: " + ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in
                                                             machine["matmul_flops"][dtype][str(th)]) + " GFLOP/s")
    rounds = 1 if quick else 3          # a shared machine: the best of several rounds, each a best of several
    machine["elementwise_s_per_element"] = {d: _least([measure_elementwise(d) for _ in range(rounds)]) for d in DTYPES}
    machine.update(_least([measure_overheads() for _ in range(rounds)]))
    machine["fresh_memory_s_per_byte"] = fresh
    if device == "cuda":
        import cupy
        machine["device_memory_bytes"] = int(cupy.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"])
    fp32 = machine["elementwise_s_per_element"]["float32"]
    log("elementwise fp32 (ns per element): " + ", ".join(f"{k} {v * 1e9:.2f}" for k, v in fp32.items()) + "; NumPy call "
        f"{machine['numpy_call_s'] * 1e6:.2f} us; autograd node {machine['autograd_node_s'] * 1e6:.1f} us; per parameter: "
        f"Adam {machine['optimizer_param_s'] * 1e6:.1f} us, DDP {machine['ddp_param_s'] * 1e6:.1f} us; collective call "
        f"{machine['collective_call_s'] * 1e6:.1f} us; span {machine['trace_span_s'] * 1e6:.1f} us; pipeline action "
        f"{machine['pipeline_action_s'] * 1e6:.1f} us; new memory "
        f"{machine['fresh_memory_s_per_byte'] * 1e6 * 4096:.2f} us per 4 KiB page")
    machine["collectives"] = {}
    msg_sizes = [1 << k for k in range(12, 23 if quick else 25, 2)]
    import tempfile
    for p in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "collectives.json")
            run_mpi([sys.executable, "-m", "minitrain.plan.calibrate", "--worker", out,
                     "--sizes", *map(str, msg_sizes)], n=p, timeout=600)
            with open(out) as f:
                for name, fit in json.load(f).items():
                    machine["collectives"].setdefault(name, {})[str(p)] = fit
                    log(f"{name} p={p}: alpha {fit['alpha_s'] * 1e6:.1f} us, "
                        f"{1 / fit['beta_s_per_byte'] / 1e9:.2f} GB/s")
    return machine


def merge(machines):
    """Several calibrations of one machine as one: the fastest of each measurement (a shared machine is
    never faster than it can be), the median of the new-memory costs, the collective fits that predict the
    least time for 1 MiB. How machines/cpu-2core.json was made from calibrations at different hours."""
    def fastest_rate(d, th, n):
        return max(r for m in machines for nn, r in m["matmul_flops"][d].get(th, []) if nn == n)

    def having(key):
        return [m[key] for m in machines if key in m]
    out = dict(machines[0])
    out["matmul_flops"] = {d: {th: [[n, fastest_rate(d, th, n)] for n in sorted({nn for m in machines
                                                                                for nn, _ in m["matmul_flops"][d].get(th, [])})]
                               for th in machines[0]["matmul_flops"][d]} for d in DTYPES}
    out["elementwise_s_per_element"] = {d: _least(having("elementwise_s_per_element"), d) for d in DTYPES}
    for key in ("numpy_call_s", "autograd_node_s", "optimizer_param_s", "ddp_param_s", "collective_call_s",
                "trace_span_s", "pipeline_action_s"):
        out[key] = min(having(key)) if having(key) else 0.0
    out["fresh_memory_s_per_byte"] = float(np.median(having("fresh_memory_s_per_byte")))

    def one_mib(name, p, fit):
        steps, sent = COLLECTIVES[name](int(p), 1 << 20)
        return fit["alpha_s"] * steps + fit["beta_s_per_byte"] * sent
    out["collectives"] = {name: {p: min((m["collectives"][name][p] for m in machines if p in m["collectives"].get(name, {})),
                                        key=lambda fit: one_mib(name, p, fit))
                                 for p in sorted({q for m in machines for q in m["collectives"].get(name, {})})}
                          for name in COLLECTIVES}
    out["measured"] = "best of: " + ", ".join(m["measured"] for m in machines)
    return out


def _least(dicts, dtype=None):
    """Key by key, the smallest of several measurements of the same seconds (of one dtype's table)."""
    dicts = [d[dtype] for d in dicts] if dtype else dicts
    return {k: min(d[k] for d in dicts if k in d) for k in set().union(*dicts)}


def _memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _blas_threads(n):
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=n)


def main(argv=None):
    from .. import cli
    p = argparse.ArgumentParser(prog="python -m minitrain.plan calibrate", description=__doc__.splitlines()[0],
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_PATH), help="where to write the JSON")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="collectives measured at these p")
    p.add_argument("--quick", action="store_true", help="fewer sizes (seconds instead of a minute)")
    p.add_argument("--name", help="the machine's name in the JSON (default: this host's)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write the best of these calibrations instead (default: measure this machine)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.sizes)
    if any(r < 2 for r in args.ranks):
        p.error("--ranks: collectives need at least 2 ranks")
    if args.merge:
        machine = merge([load_machine(path) for path in args.merge])
    else:
        machine = calibrate(args.ranks, args.quick)
    if args.name:
        machine["name"] = args.name
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

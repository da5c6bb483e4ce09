"""Machine constants, measured: python -m minitrain.plan calibrate [--out PATH] [--ranks 2 4] [--merge ...].

What the time model needs, each measured the way the jobs run it (their BLAS threads, their held heap:
backend.hold_host_memory; on the CPU by the CPU time of the measuring thread where one thread does the
work, which other jobs on a shared machine inflate least, else by the wall clock; the best of several;
arrays used in sequence, each call on its own, as a step uses them: ops.in_sequence):
* matmul FLOP rate by dtype: square n x n x n, a grid of m rows x w-wide weights (a Linear's product), and
  per product of a batch of 64 (NumPy's batched matmul); CPU: at 1 BLAS thread and at every core;
* each op of the library (plan/ops.py: LayerNorm, GELU, softmax, the loss, the optimizers' update, ...)
  per call and per element, fitted at two sizes, and seconds per element of plain passes (simple,
  transcendental, reduction, in place, scatter); the cost of first touching new memory (arrays beyond
  the held heap's 32 MiB);
* the Python a step pays beyond its arithmetic (plan/overheads.py): per NumPy call, graph node, parameter,
  traced span and collective call; DDP, FSDP and a pipeline's runtime in a real 2-rank job, and what one of
  the pipeline's stage-to-stage messages takes as its runtime meets it; the anchor, and how much slower a
  job's median step computes than these best cases (typical_alone, typical_job: both ranks at once, the
  slower setting the pace; typical_job_waited: each run after a wait asleep, as a pipeline's stage);
* latency alpha and inverse bandwidth beta of point-to-point messages and of each collective algorithm
  (minitrain's own, under mpiexec -n p), fitted to t = steps·alpha + bytes·beta with the algorithm's
  own step and byte counts (comm/collectives.py's cost table), by the wall clock and by the calling
  thread's CPU time outside its waits (and, for comparison, as a job meets them: "job_*", each after the
  anchor's compute; the planner prices the later rank's arrival with the compute instead: time.typical).
With MINITRAIN_DEVICE=cuda the matmuls, elementwise ops and collectives run on CuPy arrays.
The result is JSON at ~/.cache/minitrain/machine.json (what plan uses by default); the
committed machines/cpu-2core.json is the least loaded of three calibrations of the 2-core CI machine, each
run while other processes used under 10% of its cores (calibrate --out A, B, C; then --merge A B C);
machines/a100-80gb.json is NVIDIA's datasheet (not measured).
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

from .. import cli
from .ops import in_sequence, measure_ops

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


def _best(fn, repeats, sync, clock=time.perf_counter):
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        sync()
        best = min(best, clock() - t)
    return best


def _clock(threads=1):
    """The measuring thread's CPU time on a CPU where it alone works (see the module docstring), else the wall."""
    from .. import backend
    return time.thread_time if backend.get_device() == "cpu" and threads == 1 else time.perf_counter


def _dtype(name):
    from ..backend import bfloat16
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def measure_matmul(dtype, sizes, repeats=5, batch=1, clock=time.perf_counter):
    """[[n, FLOP/s]] for n x n @ n x n (``batch`` > 1: per product of a batch of them, one NumPy call), run
    in sequence on distinct operands, the products kept (ops.in_sequence: as a step runs them)."""
    xp, sync = _xp()
    out = []
    for n in sizes:
        shape = (n, n) if batch == 1 else (batch, n, n)
        copies = int(min(16, max(2, (16 << 20) // (3 * 4 * batch * n * n))))      # ~16 MiB of operands
        rng = np.random.default_rng(0)
        pairs = [[xp.asarray(rng.random(shape)).astype(_dtype(dtype)) for _ in range(2)] for _ in range(copies)]
        slow = dtype == "float16" and xp is np and n * batch ** (1 / 3) >= 64     # no BLAS for fp16 on NumPy
        runs = [(lambda a=a, b=b: a @ b) for a, b in (pairs[:2] if slow else pairs)]
        out.append([n, batch * 2 * n ** 3 / in_sequence(runs, sync, 1 if slow else repeats, clock)])
    return out


ROWS, WIDTHS = (8, 32, 128, 512), (16, 64, 256, 1024)


def measure_matmul_rows(dtype, repeats=5, clock=time.perf_counter):
    """{"rows": ROWS, "width": WIDTHS, "flops": [[FLOP/s]]}: m x w @ w x w products (a Linear layer's: m rows,
    a w x w weight, transposed), each on its own weight, in sequence (ops.in_sequence). A few rows on a wide
    weight run far below the square product of the same FLOPs (measured here: 32 rows x 256 at 35 GFLOP/s,
    128^3 at 80): the weight is read and packed for few rows. float16 (no BLAS on NumPy): the small corner only."""
    xp, sync = _xp()
    rng = np.random.default_rng(0)
    table = []
    for m in ROWS:
        row = []
        for w in WIDTHS:
            if dtype == "float16" and xp is np and m * w * w > 1 << 16:
                row.append(row[-1] if row else table[-1][0])
                continue
            copies = int(min(16, max(2, (16 << 20) // (4 * (2 * m * w + w * w)))))
            sets = [(xp.asarray(rng.random((m, w))).astype(_dtype(dtype)), xp.asarray(rng.random((w, w))).astype(_dtype(dtype)))
                    for _ in range(copies)]
            row.append(2 * m * w * w / in_sequence([(lambda a=a, b=b: a @ b.T) for a, b in sets], sync, repeats, clock))
        table.append(row)
    return {"rows": list(ROWS), "width": list(WIDTHS), "flops": table}


def measure_elementwise(dtype, n=1 << 18, repeats=5, clock=time.perf_counter, copies=8):
    """Seconds per element of the kinds of elementwise work a step does: ``simple`` (a + b, a new
    array), ``inplace`` (a += b), ``transcendental`` (tanh, exp), ``reduce`` (a sum along the last axis) and ``scatter``
    (an embedding's backward: rows added at repeated indices); each in sequence on distinct arrays (ops.in_sequence)."""
    xp, sync = _xp()
    from ..backend import scatter_add
    rng = np.random.default_rng(0)
    sets = [[xp.asarray(rng.random(n)).astype(_dtype(dtype)) for _ in range(2)] for _ in range(copies)]
    index = xp.asarray(rng.integers(0, 97, n // 64))
    kinds = {"simple": lambda a, b: (lambda: a + b), "inplace": lambda a, b: (lambda: a.__iadd__(b)),
             "transcendental": lambda a, b: (lambda: xp.tanh(a)),
             "reduce": lambda a, b: (lambda: a.reshape(-1, 64).sum(axis=-1, keepdims=True)),
             "scatter": lambda a, b: (lambda t=xp.zeros((97, 64), a.dtype): scatter_add(t, index, a.reshape(-1, 64)))}
    return {kind: in_sequence([make(a, b) for a, b in sets], sync, repeats if kind != "scatter" else 2, clock) / n
            for kind, make in kinds.items()}


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
    """Under mpiexec: time every collective at every size (best of 8, slowest rank), by the wall clock and by
    the CPU time the calling thread spends outside its waits (its copies, reductions and calls: the part a
    shared machine distorts least, which the jobs report as busy); and as a job meets it ("job_*": the median
    of 9, each called after the anchor's few milliseconds of compute, without a barrier, so the ranks arrive
    apart and the caches are the compute's: on this 2-core machine 1.5-3x the best case; only where the ranks
    fit the cores); rank 0 writes JSON."""
    from .. import backend, comm as mtcomm
    c = mtcomm.init()
    backend.hold_host_memory()          # freed memory kept, as the jobs run (else the anchor faults after a 16 MiB one)
    xp, sync = backend.xp(), backend.synchronize
    results = {}
    from ..comm.communicator import waiting_cpu_seconds
    from .overheads import anchor
    # ranks that outnumber the cores take turns: an in-a-job median would count the turns, which the planner
    # already charges to the compute (its ranks / cores factor); there, the best case only
    fits_the_cores = backend.get_device() != "cpu" or c.size <= (os.cpu_count() or 1)
    for name in COLLECTIVES:
        points, busy, in_job = [], [], []
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
            times, own = [], []
            for _ in range(9):
                c.barrier()
                t, cpu = time.perf_counter(), time.thread_time() - waiting_cpu_seconds()
                op()
                sync()
                times.append(time.perf_counter() - t)
                own.append(time.thread_time() - waiting_cpu_seconds() - cpu)
            job = []
            for _ in range(9 if fits_the_cores else 0):         # as a job meets it: after its compute, unaligned
                anchor()
                t = time.perf_counter()
                op()
                sync()
                job.append(time.perf_counter() - t)
            mine = np.array([min(times[1:]), min(own[1:]), np.median(job) if job else 0.0])   # best of 8, as the others
            slowest = mtcomm.all_reduce(c, mine, op="max")
            points.append((nbytes, float(slowest[0])))
            busy.append((nbytes, float(slowest[1])))
            in_job.append((nbytes, float(slowest[2])))
        if points and c.rank == 0:
            results[name] = fit_alpha_beta(points, name, c.size)
            own_fit = fit_alpha_beta(busy, name, c.size)
            results[name].update(busy_alpha_s=own_fit["alpha_s"], busy_beta_s_per_byte=own_fit["beta_s_per_byte"],
                                 busy_points=own_fit["points"])
            if fits_the_cores:
                job_fit = fit_alpha_beta(in_job, name, c.size)
                results[name].update(job_alpha_s=job_fit["alpha_s"], job_beta_s_per_byte=job_fit["beta_s_per_byte"],
                                     job_points=job_fit["points"])
    if c.size == 2:
        from .overheads import measure_in_a_job
        results["overheads"] = measure_in_a_job(c)
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
    if device == "cpu" and backend.hold_host_memory():      # then, as the jobs run: freed memory held
        machine["held_array_bytes"] = backend.HELD_ARRAY_BYTES
    threads = [1, cores] if device == "cpu" and cores > 1 else [1]
    rounds = 1 if quick else 3          # a shared machine: the best of several rounds, each a best of several
    machine["matmul_batched_flops"] = {}
    for dtype in DTYPES:
        machine["matmul_flops"][dtype], machine["matmul_batched_flops"][dtype] = {}, {}
        for th in threads:
            with _blas_threads(th):
                clock = _clock(th)
                square = [n for n in sizes if dtype != "float16" or device != "cpu" or n <= 128]
                machine["matmul_flops"][dtype][str(th)] = _most([measure_matmul(
                    dtype, square, repeats=3 if quick else 7, clock=clock) for _ in range(rounds)])
                machine.setdefault("matmul_rows_flops", {}).setdefault(dtype, {})[str(th)] = _most_grid(
                    [measure_matmul_rows(dtype, repeats=3 if quick else 5, clock=clock) for _ in range(rounds)])
                machine["matmul_batched_flops"][dtype][str(th)] = _most([measure_matmul(
                    dtype, [n for n in (8, 16, 32, 64, 128) if n in square or n < 16], repeats=3 if quick else 5,
                    batch=64, clock=clock) for _ in range(rounds)])
            square, batched = machine["matmul_flops"][dtype][str(th)], machine["matmul_batched_flops"][dtype][str(th)]
            log(f"matmul {dtype} x{th} threads: " + ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in square)
                + " GFLOP/s; batched x64: " + ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in batched))
    with _blas_threads(1):
        clock = _clock(1)
        machine["elementwise_s_per_element"] = {d: _least([measure_elementwise(d, clock=clock) for _ in range(rounds)])
                                                for d in DTYPES}
        xp, sync = _xp()
        machine["ops"] = {d: _least_fits([measure_ops(_dtype(d), xp, sync, clock=clock) for _ in range(rounds)])
                          for d in DTYPES}
        from .overheads import measure_overheads
        machine.update(_least([measure_overheads(clock=clock) for _ in range(rounds)]))
        from .overheads import measure_anchor, measure_node_overheads
        anchors = [measure_anchor() for _ in range(rounds)]     # (again after the collectives: a burst of another
        machine["anchor_cpu_time_s"] = min(anchors)            # process over these rounds alone is not the machine)
        from .overheads import typical_over_best                      # (and on both ranks at once: in a job)
        machine["typical_alone"] = min(typical_over_best() for _ in range(rounds))
        fits = [measure_node_overheads(machine, clock=clock) for _ in range(rounds)]   # a pair: the best round's
        machine.update(min(fits, key=lambda f: 54 * f["autograd_node_s"] + 29 * f["leaf_grad_s"]))
    machine["fresh_memory_s_per_byte"] = fresh
    if device == "cuda":
        import cupy
        machine["device_memory_bytes"] = int(cupy.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"])
    fp32 = machine["elementwise_s_per_element"]["float32"]
    log("elementwise fp32 (ns per element): " + ", ".join(f"{k} {v * 1e9:.2f}" for k, v in fp32.items()) + "; NumPy call "
        f"{machine['numpy_call_s'] * 1e6:.2f} us; autograd node {machine['autograd_node_s'] * 1e6:.1f} us; first gradient "
        f"of a parameter {machine['leaf_grad_s'] * 1e6:.1f} us; per parameter: "
        f"Adam {machine['optimizer_param_s'] * 1e6:.1f} us, DDP {machine['ddp_param_s'] * 1e6:.1f} us; collective call "
        f"{machine['collective_call_s'] * 1e6:.1f} us; span {machine['trace_span_s'] * 1e6:.1f} us; pipeline action "
        f"{machine['pipeline_action_s'] * 1e6:.1f} us (one rank); new memory "
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
                    if name == "overheads":
                        machine.update(fit)
                        log("in a 2-rank job: DDP adds " + f"{fit['ddp_step_s'] * 1e6:.0f} us a step + "
                            f"{fit['ddp_byte_s'] * 1e9:.2f} ns a gradient byte; FSDP {fit['fsdp_unit_s'] * 1e6:.0f} us a unit; "
                            f"a pipeline's action {fit['pipeline_action_s'] * 1e6:.0f} us, its message "
                            f"{fit['pipeline_message_s'] * 1e6:.0f} us + "
                            f"{fit['pipeline_message_byte_s'] * 1e9:.2f} ns a byte")
                        continue
                    machine["collectives"].setdefault(name, {})[str(p)] = fit
                    log(f"{name} p={p}: alpha {fit['alpha_s'] * 1e6:.1f} us, "
                        f"{1 / fit['beta_s_per_byte'] / 1e9:.2f} GB/s")
    if device == "cpu":
        machine["anchor_cpu_time_s"] = min(anchors + [measure_anchor()])
    return machine


# what the communication code's cost decides: recalibrated alone (--comm-only) when only that code changed
COMM_SCALARS = ("collective_call_s", "ddp_step_s", "ddp_byte_s", "fsdp_unit_s", "pipeline_action_s",
                "pipeline_action_byte_s", "pipeline_message_s", "pipeline_message_byte_s")


def merge(machines, comm_only=None):
    """Several calibrations of one machine as one: the least loaded whole (its anchor ran fastest; every
    constant in it was measured under that same load, which the jobs' own anchor then scales), with the
    collective fits, measured apart under mpiexec, that predict the least time for 1 MiB. How
    machines/cpu-2core.json was made. (Calibrations without an anchor: the first.) ``comm_only``: an earlier
    calibration keeps everything but the communication's costs, which come from these (the collectives as
    above, COMM_SCALARS each the least): for a change to the communication code alone (cpu-2core.json's
    collectives were remeasured so when every collective began checking its header with a neighbour)."""
    measured = ", ".join(m["measured"] for m in machines)
    if comm_only is not None:
        out = {**comm_only, **_least([{k: m[k] for k in COMM_SCALARS if k in m} for m in machines])}
        out["measured"] = f"{comm_only['measured']}; communication costs: the best of {measured}"
    else:
        out = dict(min(machines, key=lambda m: m.get("anchor_cpu_time_s", math.inf)))
        out["measured"] = f"{out['measured']}, the least loaded of: {measured}"
    out["collectives"] = {name: {p: _best_collective(machines, name, p)
                                 for p in sorted({q for m in machines for q in m["collectives"].get(name, {})})}
                          for name in COLLECTIVES}
    return out


def _best_collective(machines, name, p):
    """Of several calibrations' fits of one collective at p ranks, the best case's and the in-a-job one's
    that predict the least time for 1 MiB, chosen apart (the least disturbed of each)."""
    def one_mib(fit, kind=""):
        steps, sent = COLLECTIVES[name](int(p), 1 << 20)
        return fit[kind + "alpha_s"] * steps + fit[kind + "beta_s_per_byte"] * sent
    fits = [m["collectives"][name][p] for m in machines if p in m["collectives"].get(name, {})]
    out = dict(min(fits, key=one_mib))
    in_job = [fit for fit in fits if "job_alpha_s" in fit]
    if in_job:
        out.update({k: v for k, v in min(in_job, key=lambda fit: one_mib(fit, "job_")).items() if k.startswith("job_")})
    return out


def _most(curves):
    """Point by point, the fastest of several measurements of one [[n, FLOP/s]] curve."""
    return [[n, max(c[i][1] for c in curves)] for i, (n, _) in enumerate(curves[0])]


def _most_grid(grids):
    """Cell by cell, the fastest of several measurements of one rows x width grid."""
    return {**grids[0], "flops": [[max(g["flops"][i][j] for g in grids) for j in range(len(row))]
                                  for i, row in enumerate(grids[0]["flops"])]}


def _least_fits(tables, n=32768):
    """Op by op, the fit of several (per call, per element) that predicts the least time for n elements."""
    return {k: min((t[k] for t in tables if k in t), key=lambda fit: fit[0] + n * fit[1])
            for k in set().union(*tables)}


def _least(dicts):
    """Key by key, the smallest of several measurements of the same seconds."""
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
    p = argparse.ArgumentParser(prog="python -m minitrain.plan calibrate", description=__doc__.splitlines()[0],
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_PATH), help="where to write the JSON")
    p.add_argument("--ranks", type=cli.positive_int, nargs="+", default=[2, 4], help="collectives measured at these p")
    p.add_argument("--quick", action="store_true", help="fewer sizes (seconds instead of a minute)")
    p.add_argument("--name", help="the machine's name in the JSON (default: this host's)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write the best of these calibrations instead (default: measure this machine)")
    p.add_argument("--comm-only", metavar="JSON",
                   help="with --merge: keep this calibration but for the communication's costs, taken from the "
                        "merged ones (default: merge everything)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=cli.positive_int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.sizes)
    if args.comm_only and not args.merge:
        p.error("--comm-only: only with --merge")
    if any(r < 2 for r in args.ranks):
        p.error("--ranks: collectives need at least 2 ranks")
    if args.merge:
        machine = merge([load_machine(path) for path in args.merge],
                        load_machine(args.comm_only) if args.comm_only else None)
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

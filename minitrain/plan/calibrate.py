"""Machine constants, measured: python -m minitrain.plan calibrate [--out PATH] [--ranks 2 4] [--merge ...].

What the time model needs, each measured the way the jobs run it (their BLAS threads, their held heap:
backend.hold_host_memory; on the CPU by the CPU time of the measuring thread where one thread does the
work, which other jobs on a shared machine inflate least, else by the wall clock; the best of several;
arrays used in sequence, each call on its own, as a step uses them: ops.in_sequence):
* matmul FLOP rate by dtype: square n x n x n, a grid of m rows x w-wide weights (a Linear's product), and
  per product of a batch of 64 (NumPy's batched matmul); CPU: at 1 BLAS thread, at every core and at each
  cores / ranks of the ranks calibrated (a rank's threads, as the jobs give them; costs.py interpolates between);
* each op of the library (plan/ops.py: LayerNorm, GELU, softmax, the loss, the optimizers' update, ...)
  per call and per element, fitted at two sizes, and seconds per element of plain passes (simple,
  transcendental, reduction, in place, scatter); the cost of first touching new memory (arrays beyond
  the held heap's 32 MiB);
* the Python a step pays beyond its arithmetic: per NumPy call, graph node, parameter, traced span and
  collective call (plan/overheads.py); DDP, FSDP and a pipeline's runtime in a real 2-rank job, and what one
  of the pipeline's stage-to-stage messages takes as its runtime meets it (plan/job_overheads.py); the
  anchor, and how much slower a job's median step computes than these best cases (plan/anchor.py;
  typical_alone, typical_job: both ranks at once, the slower setting the pace; typical_job_waited: each run
  after a wait asleep, as a pipeline's stage);
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
import os
import pathlib
import platform
import sys
import time

import numpy as np

from .. import cli
from .collective_fits import ROUNDS, _worker
from .merge import _least, _least_fits, _most, _most_grid, merge
from .microbench import (_clock, _dtype, _xp, measure_elementwise, measure_fresh_memory, measure_matmul,
                         measure_matmul_rows)
from .ops import measure_ops

MACHINES = pathlib.Path(__file__).parent / "machines"
DEFAULT_PATH = pathlib.Path(os.environ.get("MINITRAIN_CACHE", pathlib.Path.home() / ".cache" / "minitrain")) / "machine.json"
DTYPES = ("float32", "float64", "float16", "bfloat16")


class MachineError(ValueError):
    """A machine that is not there, or a file that is not a machine's constants (the CLIs say it in one line)."""


REQUIRED = ("name", "device", "matmul_flops", "elementwise_s_per_element", "numpy_call_s", "autograd_node_s",
            "fresh_memory_s_per_byte")          # what every machine file has, measured (calibrate) or from a datasheet


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
        raise MachineError(f"no machine {name!r}: give a JSON path or one of {known} "
                           f"(python -m minitrain.plan calibrate writes {DEFAULT_PATH})")
    try:
        with open(path) as f:
            machine = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MachineError(f"cannot read the machine {str(path)!r}: {e}") from None
    missing = [key for key in REQUIRED if key not in machine] if isinstance(machine, dict) else list(REQUIRED)
    if missing:
        raise MachineError(f"{str(path)!r} is not a machine's constants (no {', '.join(missing)}): python -m "
                           f"minitrain.plan calibrate writes one")
    return machine


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
    # each rank's BLAS threads as the jobs give them (cores / ranks) for the ranks calibrated, 1 and the cores:
    # costs.py interpolates between these
    threads = sorted({1, cores, *(max(1, cores // p) for p in ranks)}) if device == "cpu" else [1]
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
                batched = [n for n in (8, 16, 32, 64, 128) if n in square or n < 16]
                if dtype == "float16" and device == "cpu":      # no BLAS: 64 products no larger than the square's
                    batched = [n for n in batched if 64 * n ** 3 <= max(square) ** 3]
                machine["matmul_batched_flops"][dtype][str(th)] = _most([measure_matmul(
                    dtype, batched, repeats=3 if quick else 5, batch=64, clock=clock) for _ in range(rounds)])
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
        from .anchor import measure_anchor
        from .overheads import measure_node_overheads
        anchors = [measure_anchor() for _ in range(rounds)]     # (again after the collectives: a burst of another
        machine["anchor_cpu_time_s"] = min(anchors)            # process over these rounds alone is not the machine)
        from .anchor import typical_over_best                         # (and on both ranks at once: in a job)
        machine["typical_alone"] = min(typical_over_best() for _ in range(rounds))
        fits = [measure_node_overheads(machine, clock=clock) for _ in range(rounds)]   # a pair: the best round's
        machine.update(min(fits, key=lambda f: 54 * f["autograd_node_s"] + 29 * f["leaf_grad_s"]))
        from .overheads import measure_ring_pair
        machine.update(min((measure_ring_pair(machine, clock=clock) for _ in range(rounds)),
                           key=lambda f: f["ring_pair_s"]))
    machine["fresh_memory_s_per_byte"] = fresh
    if device == "cuda":
        import cupy
        machine["device_memory_bytes"] = int(cupy.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"])
        machine["gpus_per_node"] = cupy.cuda.runtime.getDeviceCount()     # the ranks that share this host's memory
    fp32 = machine["elementwise_s_per_element"]["float32"]
    log("elementwise fp32 (ns per element): " + ", ".join(f"{k} {v * 1e9:.2f}" for k, v in fp32.items()) + "; NumPy call "
        f"{machine['numpy_call_s'] * 1e6:.2f} us; autograd node {machine['autograd_node_s'] * 1e6:.1f} us; first gradient "
        f"of a parameter {machine['leaf_grad_s'] * 1e6:.1f} us; per parameter: "
        f"Adam {machine['optimizer_param_s'] * 1e6:.1f} us, DDP {machine['ddp_param_s'] * 1e6:.1f} us; collective call "
        f"{machine['collective_call_s'] * 1e6:.1f} us; span {machine['trace_span_s'] * 1e6:.1f} us; pipeline action "
        f"{machine['pipeline_action_s'] * 1e6:.1f} us (one rank); new memory "
        f"{machine['fresh_memory_s_per_byte'] * 1e6 * 4096:.2f} us per 4 KiB page")
    machine["collectives"] = {}
    msg_sizes = [1 << k for k in range(12, 21 if quick else 25, 2)]      # quick: 4 KiB to 1 MiB
    import tempfile
    for p in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "collectives.json")
            run_mpi([sys.executable, "-m", "minitrain.plan.calibrate", "--worker", out,
                     "--sizes", *map(str, msg_sizes), "--rounds", str(rounds)], n=p, timeout=600)
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


def _memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _blas_threads(n):
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=n)


def _machine_name(text):
    """--name: the machine's name in the JSON, not blank (the planner's reports name the machine by it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the machine's name must not be blank")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minitrain.plan calibrate", description=__doc__.splitlines()[0],
                                formatter_class=cli.HelpFormatter, allow_abbrev=False)
    p.add_argument("--out", type=cli.output_file, metavar="PATH",
                   help=f"where to write the JSON, in a folder that exists (default: {DEFAULT_PATH}, its folder "
                        f"made if missing)")
    p.add_argument("--ranks", type=cli.at_least(2, "a collective on one rank sends nothing to measure"), nargs="+",
                   action=cli.Distinct, default=[2, 4], help="collectives measured at these p")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes (messages of 4 KiB to 1 MiB, one round): seconds instead of a minute")
    p.add_argument("--name", type=_machine_name, help="the machine's name in the JSON (default: this host's)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write the best of these calibrations instead (default: measure this machine)")
    p.add_argument("--comm-only", metavar="JSON",
                   help="with --merge: keep this calibration but for the communication's costs, taken from the "
                        "merged ones (default: merge everything)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=cli.positive_int, nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=cli.positive_int, default=ROUNDS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.sizes, args.rounds)
    if args.comm_only and not args.merge:
        p.error("--comm-only: only with --merge")
    if args.merge:
        for option in sorted(cli.given_options(p, argv if argv is not None else sys.argv[1:]) & {"--ranks", "--quick"}):
            cli.refuse(p, option, "--merge", "merging measures nothing")
    # checked now, not after a minute of measuring; the default's folder (the cache) is made as a cache is
    path = args.out or str(DEFAULT_PATH)
    if args.out is None:
        try:
            DEFAULT_PATH.parent.mkdir(parents=True, exist_ok=True)
            cli.output_file(path)
        except (OSError, argparse.ArgumentTypeError) as e:
            p.error(f"cannot write the default {path}: {e} (give --out PATH)")
    if args.merge:
        try:
            machines = [load_machine(name) for name in args.merge]
            comm_only = load_machine(args.comm_only) if args.comm_only else None
        except MachineError as e:
            p.error(str(e))
        machine = merge(machines, comm_only)
    else:
        machine = calibrate(args.ranks, args.quick)
    if args.name is not None:
        machine["name"] = args.name
    with open(path, "w") as f:
        json.dump(machine, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    cli.run_command(main)

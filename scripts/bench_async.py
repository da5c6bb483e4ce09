"""An asynchronous collective against the same collective called synchronously, in the same run.

    python scripts/bench_async.py [--ranks 2 4] [--max-mib 16] [--repeats 101] [--api comm|distributed] [--json out.json]

Launches itself under mpiexec -n p for each p. Sizes from 1 KiB to --max-mib MiB (float32, x4
steps). For each size, minitrain.comm.all_reduce(comm, x, out=out) (sync) and
all_reduce(comm, x, out=out, async_op=True).wait() (async: the Work handle and whatever runs it,
work.py) alternate (ABAB, each call after an MPI_Barrier, so that a machine shared with other jobs
slows both alike); a mode's time is the slowest rank's median over the repeats. Prints the times
and the ratio async / sync per size, of the medians and paired (the median over repeats of each
async call's time over the sync call's beside it, each the slowest rank's: load that drifts within
a size cancels), and the largest of each (issue 29 asks for at most 1.2x). --api distributed times the
same through torch.distributed's call shape instead: minitrain.distributed.all_reduce(t) in place, and
all_reduce(t, async_op=True).wait().
Also, per p, the CPU seconds the communicator's progress thread used over the whole run (read from
/proc: its utime + stime), which an async call that wakes it pays for.
"""
import argparse
import json
import os
import time

import numpy as np

from minitrain import cli


def thread_cpu_seconds(native_id):
    """utime + stime of one thread of this process (Linux /proc), seconds; None elsewhere."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def calls(api, x, out):
    """(communicator, {"sync": call, "async": call}) of one all-reduce of x, through ``api``."""
    if api == "distributed":
        import minitrain.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("mpi")
        return dist.group.WORLD.comm, {"sync": lambda: dist.all_reduce(x),
                                       "async": lambda: dist.all_reduce(x, async_op=True).wait()}
    from minitrain.comm import all_reduce, init
    comm = init()
    return comm, {"sync": lambda: all_reduce(comm, x, out=out),
                  "async": lambda: all_reduce(comm, x, out=out, async_op=True).wait()}


def worker(args):
    from mpi4py import MPI
    comm = None

    def one(fn):
        if args.api == "distributed":       # in place: each sum would multiply x by p (inf in float32 by call 64)
            x[...] = 1
        mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows, size = [], 1024
    while size <= args.max_mib * (1 << 20):
        x = np.ones(size // 4, np.float32)
        out = np.empty_like(x)
        comm, modes = calls(args.api, x, out)
        mpi = comm.mpi_comm
        for m, fn in modes.items():                     # warm up (first call: buffers, the thread), and check
            x[...] = 1
            fn()
            result = x if args.api == "distributed" else out
            assert np.all(result == comm.size), (m, result[:4])
        once = max(one(fn) for fn in modes.values())
        repeats = int(np.clip(args.min_time / max(once, 1e-6), 3, args.repeats))
        repeats = mpi.allreduce(repeats, op=MPI.MAX)    # the same count on every rank
        times = {m: [] for m in modes}
        for i in range(repeats):
            order = list(modes) if i % 2 == 0 else list(modes)[::-1]    # ABBA: neither always goes first
            for m in order:
                times[m].append(one(modes[m]))
        medians = {m: mpi.allreduce(float(np.median(t)), op=MPI.MAX) for m, t in times.items()}
        # each async call against the sync call beside it (load that drifts during the size cancels)
        slowest = {m: np.max(mpi.allgather(np.array(t)), axis=0) for m, t in times.items()}
        paired = float(np.median(slowest["async"] / slowest["sync"]))
        rows.append({"bytes": size, "repeats": repeats, **medians, "ratio": medians["async"] / medians["sync"],
                     "paired_ratio": paired})
        size *= 4
    progress = comm._progress
    native = getattr(getattr(progress, "_thread", None), "native_id", None)
    cpu = thread_cpu_seconds(native) if native else None
    cpu = mpi.allreduce(cpu if cpu is not None else -1.0, op=MPI.MAX)
    if comm.rank == 0:
        from minitrain.comm import mpi_library
        with open(args.worker_out, "w") as f:
            json.dump({"p": comm.size, "api": args.api, "mpi_library": mpi_library(), "rows": rows,
                       "progress_thread_cpu_s": None if cpu < 0 else cpu}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.at_least(2, "one rank's all-reduce sends nothing to overlap"), nargs="+",
                    action=cli.Distinct, default=[2, 4],
                    help="ranks (one mpiexec launch each)")
    ap.add_argument("--max-mib", type=cli.largest_mib, default=16, help="largest size, MiB (from 1 KiB, x4 steps)")
    ap.add_argument("--repeats", type=cli.positive_int, default=101, help="most repeats of each mode per size")
    ap.add_argument("--min-time", type=cli.positive_float, default=3.0, help="seconds per mode and size (fewer repeats if slow)")
    ap.add_argument("--api", choices=("comm", "distributed"), default="comm",
                    help="comm: minitrain.comm.all_reduce(comm, x, out=out); distributed: torch.distributed's call shape, "
                         "minitrain.distributed.all_reduce(t) in place")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    from minitrain.testing import run_worker
    results = {}
    for p in args.ranks:
        out = run_worker(__file__, p, ["--max-mib", args.max_mib, "--repeats", args.repeats,
                                       "--min-time", args.min_time, "--api", args.api])
        results[f"p{p}"] = out
        out["max_ratio"] = max(r["ratio"] for r in out["rows"])
        out["max_paired_ratio"] = max(r["paired_ratio"] for r in out["rows"])
        print(f"p = {p} ranks, MPI: {out['mpi_library']}; {args.api}'s all_reduce, float32, slowest rank's median, "
              "sync and async alternating")
        print(f"{'bytes':>10} {'repeats':>8} {'sync':>11} {'async+wait':>11} {'ratio':>7} {'paired':>7}")
        for r in out["rows"]:
            print(f"{r['bytes']:>10} {r['repeats']:>8} {r['sync'] * 1e6:>8.1f} us {r['async'] * 1e6:>8.1f} us "
                  f"{r['ratio']:>6.2f}x {r['paired_ratio']:>6.2f}x")
        cpu = out["progress_thread_cpu_s"]
        print(f"max ratio async / sync: {out['max_ratio']:.2f}x (of the medians), {out['max_paired_ratio']:.2f}x "
              "(median of each pair's ratio); progress thread CPU over the run: "
              + ("n/a" if cpu is None else f"{cpu:.2f} s") + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

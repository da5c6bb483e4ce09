"""Hand-written collectives vs MPI's built-ins, measured in the same run.

    python scripts/bench_collectives.py [--ranks 2 4] [--max-mib 64] [--plot collectives.png] [--json out.json]
        [--check-collectives] [--min-time 0.3]

Launches itself under mpiexec -n p for each p. Sizes from 1 KiB to 64 MiB (float32). For
each size: minitrain's ring_all_reduce, all_reduce(auto), recursive_doubling_all_reduce,
ring_reduce_scatter, ring_all_gather against MPI_Allreduce (in-place and out-of-place),
MPI_Reduce_scatter_block and MPI_Allgather. Prints the median time, algbw = bytes/time and
busbw with the nccl-tests definitions (all-reduce: algbw·2(p-1)/p; the other two: algbw·(p-1)/p),
the ratio MPI time / ours (>1 means ours is faster; for all-reduce against the faster of
MPI's two). Both sides write into preallocated outputs (out= for ours), as DDP and ZeRO do.
Also an alpha-beta fit of the ring (t = 2(p-1)·alpha + 2(p-1)/p·n·beta), and the
size where recursive doubling stops beating the ring.
"""
import argparse
import json
import os
import time

import numpy as np

from minitrain import cli


def timed(fn, comm, min_time, min_reps=3, max_reps=200):
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    reps = int(np.clip(min_time / max(once, 1e-6), min_reps, max_reps))
    reps = int(comm.mpi_comm.allreduce(reps, op=__import__("mpi4py").MPI.MAX))   # same count everywhere
    times = []
    for _ in range(reps):
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the slowest rank defines the collective's time
    return comm.mpi_comm.allreduce(float(np.median(times)), op=__import__("mpi4py").MPI.MAX)


def worker(args):
    from mpi4py import MPI
    from minitrain.comm import all_reduce, init, recursive_doubling_all_reduce, ring_all_gather, \
        ring_all_reduce, ring_reduce_scatter
    comm = init(check_collectives=args.check_collectives)
    mpi = comm.mpi_comm
    t = args.min_time
    p = comm.size
    rows = []
    size = 1024
    while size <= args.max_mib * 1024 * 1024:
        n = size // 4
        x = np.ones(n, np.float32)
        out = np.empty_like(x)
        inplace = x.copy()
        shard = np.ones(n // p, np.float32)
        gathered = np.empty(n // p * p, np.float32)
        rs_out = np.empty(n // p, np.float32)
        row = {"bytes": size, "p": p}
        mine = np.empty_like(x)   # preallocated outputs on both sides, as DDP and ZeRO use them
        row["ring_all_reduce"] = timed(lambda: ring_all_reduce(comm, x, out=mine), comm, t)
        row["all_reduce_auto"] = timed(lambda: all_reduce(comm, x, out=mine), comm, t)
        row["recursive_doubling"] = timed(lambda: recursive_doubling_all_reduce(comm, x), comm, t)
        row["mpi_allreduce_out_of_place"] = timed(lambda: mpi.Allreduce(x, out), comm, t)
        row["mpi_allreduce_in_place"] = timed(lambda: mpi.Allreduce(MPI.IN_PLACE, inplace), comm, t)
        rs_mine = np.empty(n // p, np.float32)
        row["ring_reduce_scatter"] = timed(lambda: ring_reduce_scatter(comm, x[:n // p * p], out=rs_mine), comm, t)
        row["mpi_reduce_scatter"] = timed(lambda: mpi.Reduce_scatter_block(x[:n // p * p], rs_out), comm, t)
        ag_mine = np.empty(n // p * p, np.float32)
        row["ring_all_gather"] = timed(lambda: ring_all_gather(comm, shard, total=n // p * p, out=ag_mine), comm, t)
        row["mpi_allgather"] = timed(lambda: mpi.Allgather(shard, gathered), comm, t)
        rows.append(row)
        size *= 4
    if comm.rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)


def fmt_size(b):
    return f"{b // 1024} KiB" if b < 1 << 20 else f"{b >> 20} MiB"


def report(rows):
    p = rows[0]["p"]
    print(f"\np = {p} ranks (float32; time = median over repetitions, slowest rank)")
    print(f"{'size':>8} | {'ring AR':>9} {'auto AR':>9} {'rec.dbl':>9} {'MPI AR':>9} {'ratio':>6} {'busbw':>7} |"
          f" {'ring RS':>9} {'MPI RS':>9} {'ratio':>6} | {'ring AG':>9} {'MPI AG':>9} {'ratio':>6}")
    for r in rows:
        mpi_ar = min(r["mpi_allreduce_out_of_place"], r["mpi_allreduce_in_place"])
        algbw = r["bytes"] / r["ring_all_reduce"] / 1e9
        busbw = algbw * 2 * (p - 1) / p
        print(f"{fmt_size(r['bytes']):>8} | {r['ring_all_reduce'] * 1e3:8.3f}m {r['all_reduce_auto'] * 1e3:8.3f}m "
              f"{r['recursive_doubling'] * 1e3:8.3f}m {mpi_ar * 1e3:8.3f}m {mpi_ar / r['ring_all_reduce']:5.2f}x "
              f"{busbw:6.2f}G | {r['ring_reduce_scatter'] * 1e3:8.3f}m {r['mpi_reduce_scatter'] * 1e3:8.3f}m "
              f"{r['mpi_reduce_scatter'] / r['ring_reduce_scatter']:5.2f}x | {r['ring_all_gather'] * 1e3:8.3f}m "
              f"{r['mpi_allgather'] * 1e3:8.3f}m {r['mpi_allgather'] / r['ring_all_gather']:5.2f}x")
    sizes = np.array([r["bytes"] for r in rows], float)
    ring = np.array([r["ring_all_reduce"] for r in rows])
    slope, intercept = np.polyfit(sizes, ring, 1, w=1 / ring)   # relative errors: small sizes count too
    alpha = intercept / (2 * (p - 1))
    beta = slope * p / (2 * (p - 1))
    print(f"alpha-beta fit of the ring: alpha = {alpha * 1e6:.1f} us per message, "
          f"1/beta = {1 / beta / 1e9:.2f} GB/s per link")
    big = [r for r in rows if r["bytes"] >= 1 << 20]
    worst = min((min(r["mpi_allreduce_out_of_place"], r["mpi_allreduce_in_place"]) / r["ring_all_reduce"] for r in big),
                default=float("nan"))
    auto_worst = min(min(r["mpi_allreduce_out_of_place"], r["mpi_allreduce_in_place"]) / r["all_reduce_auto"] for r in rows)
    crossover = next((r["bytes"] for r in rows if r["recursive_doubling"] > r["ring_all_reduce"]), None)
    print(f"ring all-reduce vs the faster MPI_Allreduce from 1 MiB up: worst {worst:.2f}x (goal >= 0.95x); "
          f"all_reduce(auto) at every size: worst {auto_worst:.2f}x (goal >= 0.7x)")
    print(f"recursive doubling stops beating the ring at {fmt_size(crossover) if crossover else 'no size measured'}")
    return {"p": p, "alpha_us": alpha * 1e6, "bandwidth_GBps": 1 / beta / 1e9, "worst_ring_ratio_from_1MiB": worst,
            "worst_auto_ratio": auto_worst, "crossover_bytes": crossover}


def plot(all_rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(all_rows), figsize=(6 * len(all_rows), 4), squeeze=False)
    for ax, rows in zip(axes[0], all_rows):
        p = rows[0]["p"]
        sizes = [r["bytes"] for r in rows]
        for key, label in [("ring_all_reduce", "minitrain ring"), ("recursive_doubling", "minitrain recursive doubling"),
                           ("all_reduce_auto", "minitrain auto"), ("mpi_allreduce_in_place", "MPI in-place"),
                           ("mpi_allreduce_out_of_place", "MPI out-of-place")]:
            ax.plot(sizes, [r["bytes"] / r[key] / 1e9 * 2 * (p - 1) / p for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("all-reduce busbw (GB/s)")
        ax.set_title(f"all-reduce, p = {p}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.at_least(2, "a collective on one rank sends nothing: no bandwidth, no alpha-beta fit"),
                    nargs="+", action=cli.Distinct, default=[2, 4],
                    help="one mpiexec launch per p")
    ap.add_argument("--max-mib", type=cli.largest_mib, default=64, help="the largest message, in MiB (sizes from 1 KiB)")
    ap.add_argument("--min-time", type=cli.positive_float, default=0.3, help="seconds of repetitions per measurement")
    ap.add_argument("--check-collectives", action="store_true",
                    help="compare every collective's arguments across ranks first (the jobs' default; off here: "
                         "the table measures the algorithms)")
    ap.add_argument("--plot", metavar="PNG", type=cli.output_image, help="draw time and bus bandwidth per size (default: no plot)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    from minitrain.testing import mpi_library_name, run_worker
    all_rows, summaries = [], []
    for p in args.ranks:
        rows = run_worker(__file__, p, ["--max-mib", args.max_mib, "--min-time", args.min_time]
                          + (["--check-collectives"] if args.check_collectives else []))
        all_rows.append(rows)
        summaries.append(report(rows))
    print(f"\nmachine: {os.cpu_count()} cores, {' '.join(os.uname()[2:3])}, "
          f"MPI: {mpi_library_name()} (via mpi4py)")
    if args.plot:
        plot(all_rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": all_rows, "summary": summaries, "mpi_library": mpi_library_name()}, f, indent=1)


if __name__ == "__main__":
    main()

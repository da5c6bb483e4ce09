"""Pipeline bubbles, measured against the formula, for every schedule and number of micro-batches.

    python scripts/bench_pipeline.py [--ranks 2 4] [--steps 5] [--width 1024] [--plot bubbles.png] [--json out.json]

Model: a balanced stack of 8 x (Linear(W, W) + ReLU), W = 1024 by default, global batch 512, float32,
one BLAS thread per rank; every stage gets the same number of identical layers, so the formula's
assumption (equal stage times) holds. For each schedule (naive, gpipe, 1f1b, interleaved_1f1b with
v = 2) and m in {1, 2, 4, 8, 16}: the median step time and the measured bubble (1 - time in forward
and backward actions / the step's window from the first rank's start to the last rank's end, mean
over ranks, median over steps) beside (p-1)/(v·m+p-1)
((p-1)/p for naive). The anchor is the same model trained in one process on the whole batch: the
"speed-up" column is its step time / the pipeline's. At p=4 the 2 cores are oversubscribed: ranks
wait for a core as well as for their inputs, so the measured bubble there includes that.
"""
import argparse
import json
import time

import numpy as np

from minitrain import cli

SCHEDULES = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
MICROBATCHES = [1, 2, 4, 8, 16]
LAYERS, BATCH = 8, 512


def build(width):
    from minitrain import nn
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def data(width, steps):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, width)).astype(np.float32), rng.integers(0, width, BATCH))
            for _ in range(steps)]


def worker(args):
    import minitrain as mt
    from minitrain import nn, optim, trace
    from minitrain.comm import init, ring_all_gather
    from minitrain.parallel.pipeline import PipelineParallel
    comm = init()
    p, r = comm.size, comm.rank
    batches = data(args.width, args.steps + 1)
    results = {}
    if r == 0:                                   # the anchor: one process, the whole batch
        mt.manual_seed(0)
        model = build(args.width)
        opt = optim.SGD(model.parameters(), lr=1e-3)
        times = []
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(mt.Tensor(x)), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        results["single"] = float(np.median(times[1:]))
    comm.barrier()
    for name, v in SCHEDULES:
        for m in MICROBATCHES:
            if name == "interleaved_1f1b" and m % p:
                continue
            mt.manual_seed(0)
            pipe = PipelineParallel(build(args.width), comm, name, m, chunks=v)
            opt = optim.SGD(pipe.parameters(), lr=1e-3)
            trace.enable(rank=r)
            times, bubbles = [], []
            for x, y in batches:
                trace.tracer().events.clear()
                comm.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                pipe.train_step(x, y, nn.functional.cross_entropy)
                opt.step()
                times.append(time.perf_counter() - t0)
                bubbles.append(pipe.measured_bubble_fraction()[r])
            row = np.array([np.median(times[1:]), np.median(bubbles[1:])])
            rows = ring_all_gather(comm, row, total=2 * p).reshape(p, 2)
            results[f"{name}/m{m}"] = {"step": float(rows[:, 0].max()), "bubble": float(rows[:, 1].mean()),
                                       "bubble_per_rank": rows[:, 1].tolist(),
                                       "formula": pipe.formula_bubble_fraction(), "chunks": v, "m": m}
    if r == 0:
        with open(args.worker_out, "w") as f:
            json.dump(results, f)


def launch(p, args):
    from minitrain.testing import run_worker
    return run_worker(__file__, p, ["--steps", args.steps, "--width", args.width])


def plot(all_results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(all_results), figsize=(6 * len(all_results), 4), squeeze=False)
    for ax, (p, results) in zip(axes[0], sorted(all_results.items())):
        for i, (name, v) in enumerate(SCHEDULES):
            rows = [results[k] for k in results if k.startswith(name + "/")]
            if not rows:
                continue
            ms = [row["m"] for row in rows]
            ax.plot(ms, [row["formula"] for row in rows], "-", color=f"C{i}", label=f"{name} formula")
            ax.plot(ms, [row["bubble"] for row in rows], "o", color=f"C{i}", label=f"{name} measured")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("bubble fraction")
        ax.set_title(f"p = {p}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pipeline stages: one mpiexec launch per p")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per schedule and m")
    ap.add_argument("--width", type=int, default=1024, help="W of the 8 Linear(W, W) layers")
    ap.add_argument("--plot", metavar="PNG", help="draw the bubbles beside the formula (default: no plot)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    all_results = {}
    for p in args.ranks:
        results = launch(p, args)
        all_results[p] = results
        single = results.pop("single")
        from minitrain.testing import mpi_library_name
        print(f"\np = {p} (one process on the whole batch: {single * 1e3:.1f} ms/step; MPI: {mpi_library_name()})")
        print(f"  {'schedule':<18} {'m':>3} {'step':>9} {'speed-up':>9} {'bubble':>8} {'formula':>8} {'diff':>7}")
        for key, row in results.items():
            name = key.split("/")[0] + (f" v={row['chunks']}" if row["chunks"] > 1 else "")
            print(f"  {name:<18} {row['m']:>3} {row['step'] * 1e3:>7.1f}ms {single / row['step']:>8.2f}x "
                  f"{row['bubble']:>8.3f} {row['formula']:>8.3f} {row['bubble'] - row['formula']:>+7.3f}")
    if args.plot:
        plot(all_results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in all_results.items()}, f, indent=1)


if __name__ == "__main__":
    main()

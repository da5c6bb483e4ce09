"""Activation recomputation, measured: peak saved activations and step time vs segments.

    python scripts/bench_recompute.py [--plot recompute.png] [--json out.json]

An MLP of n layers (Linear 256x256 + ReLU, batch 256, float32) for n = 4..64, trained one step
plain and with checkpoint_sequential at k = 2, round(sqrt(n)) and n/2 segments. Prints the peak of
the activations category (minitrain.memory) and the median step time, the ratio to the plain
run (the anchor, measured in the same run), and the Chen et al. model: peak ~ k + n/k layers'
worth, smallest at k = sqrt(n), for one extra forward (forward ~ 1/3 of a step: ~ +33% time).
Then the GPT with recompute = none / selective / full.
"""
import argparse
import json
import statistics

import numpy as np
from threadpoolctl import threadpool_limits

import minitrain as mt
from minitrain import cli, memory, nn
from minitrain.parallel import checkpoint_sequential
from minitrain.testing import median_time

WIDTH, BATCH = 256, 256


def mlp(n):
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(n)])


def measure(step, repeats):
    """(peak saved activations, median step time) of ``step``."""
    tracker = memory.MemoryTracker()
    with memory.use_tracker(tracker):
        t = median_time(step, repeats)
    return tracker.peak()["activations"], t


def mlp_rows(ns, repeats):
    rng = np.random.default_rng(0)
    x = mt.Tensor(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
    rows = []
    for n in ns:
        mt.manual_seed(0)
        model = mlp(n)

        def step(k):
            model.zero_grad()
            out = model(x) if k is None else checkpoint_sequential(model, k, x)
            out.sum().backward()
        plain_peak, plain_time = measure(lambda: step(None), repeats)
        for k in sorted({2, round(n ** 0.5), n // 2}):
            peak, t = measure(lambda: step(k), repeats)
            rows.append({"n": n, "k": k, "peak": peak, "time": t, "plain_peak": plain_peak, "plain_time": plain_time})
    return rows


def gpt_rows(repeats):
    idx = np.random.default_rng(0).integers(0, 96, (16, 128))
    rows = {}
    for mode in ("none", "selective", "full"):
        mt.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=128,
                                    recompute=None if mode == "none" else mode))

        def step():
            model.zero_grad()
            model(idx, idx)[1].backward()
        rows[mode] = measure(step, repeats)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--layers", type=cli.positive_int, nargs="+", action=cli.Distinct, default=[4, 8, 16, 32, 64],
                    help="MLP depths n")
    ap.add_argument("--repeats", type=cli.positive_int, default=5, help="timed steps (the median is kept)")
    ap.add_argument("--threads", type=cli.positive_int, default=1, help="BLAS threads")
    ap.add_argument("--plot", metavar="PNG", type=cli.output_image, help="draw peak memory and time vs segments (default: no plot)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    args = ap.parse_args()
    with threadpool_limits(limits=args.threads):
        rows = mlp_rows(args.layers, args.repeats)
        gpt = gpt_rows(args.repeats)
    per_layer = BATCH * WIDTH * 4 * 2          # a Linear's input and a ReLU's output, float32
    print(f"MLP of n x (Linear {WIDTH}x{WIDTH} + ReLU), batch {BATCH}, float32, {args.threads} thread(s)")
    print(f"{'n':>3} {'k':>3} {'peak act.':>11} {'/ plain':>8} {'model (k+n/k)/n':>16} {'step':>9} {'/ plain':>8}")
    for r in rows:
        model_ratio = (r["k"] + r["n"] / r["k"]) / r["n"]
        print(f"{r['n']:>3} {r['k']:>3} {r['peak'] / 1e6:>9.2f}MB {r['peak'] / r['plain_peak']:>7.2f}x "
              f"{model_ratio:>15.2f}x {r['time'] * 1e3:>7.1f}ms {r['time'] / r['plain_time']:>7.2f}x")
    sqrt_rows = [r for r in rows if r["k"] == round(r["n"] ** 0.5)]
    overhead = statistics.median(r["time"] / r["plain_time"] for r in sqrt_rows)
    print(f"at k = sqrt(n): median time {overhead:.2f}x the plain step (Chen et al.: one extra forward, ~1.33x)")
    print("\nGPT (4 layers, n_embd 128, T 128, batch 16): recompute  peak activations  step")
    for mode, (peak, t) in gpt.items():
        print(f"  {mode:<10} {peak / 1e6:>8.2f} MB ({peak / gpt['none'][0]:.2f}x)  {t * 1e3:7.1f} ms ({t / gpt['none'][1]:.2f}x)")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        ns = [r["n"] for r in sqrt_rows]
        a1.plot(ns, [r["plain_peak"] / per_layer for r in sqrt_rows], "o-", label="plain (n)")
        a1.plot(ns, [r["peak"] / per_layer for r in sqrt_rows], "s-", label="checkpoint_sequential, k = sqrt(n)")
        a1.plot(ns, [2 * np.sqrt(n) for n in ns], "k--", label="2 sqrt(n)")
        a1.set_xscale("log", base=2); a1.set_yscale("log", base=2)
        a1.set_xlabel("layers n"); a1.set_ylabel("peak saved activations (layers' worth)"); a1.legend()
        a2.plot(ns, [r["time"] / r["plain_time"] for r in sqrt_rows], "s-", label="measured")
        a2.axhline(4 / 3, color="k", ls="--", label="one extra forward (4/3)")
        a2.set_xscale("log", base=2); a2.set_xlabel("layers n"); a2.set_ylabel("step time / plain"); a2.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"saved {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mlp": rows, "gpt": gpt, "overhead_at_sqrt_n": overhead}, f, indent=1)


if __name__ == "__main__":
    main()

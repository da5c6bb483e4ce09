"""Tensor-parallel GPT: step time and bytes per transformer layer at tp = 1, 2, 4, measured beside
Megatron's formula, in one run.

    python scripts/bench_tensor_parallel.py [--tp 1 2 4] [--steps 6] [--n-embd 256] [--json out.json]

GPT: 4 layers, n_embd 256, 8 heads, block 128, batch 8, float32, one BLAS thread per rank (so that
compute matters: ~25 M multiply-adds per token). Per configuration (TP, and TP + sequence parallelism):
the median step time (slowest rank), its speed-up over tp=1 in the same run (the anchor: the same
model in one process), the bytes one rank sends inside one block's forward (measured with hooks)
beside 2 x 2(t-1)/t·B·T·C·4 (two all-reduces of the block's activations), and the peak of saved
activations per rank (sequence parallelism cuts the replicated part by t). At tp=4 the 2 cores are
oversubscribed: the step time there measures the machine, not the method.
"""
import argparse
import json
import time

import numpy as np

from minitrain import cli

N_HEAD = 8


def worker(args):
    import minitrain as mt
    from minitrain import memory, nn, optim
    from minitrain.comm import init, ring_all_gather
    from minitrain.parallel.tensor_parallel import tensor_parallelize
    comm = init()
    t, r = comm.size, comm.rank
    mt.manual_seed(0)
    config = nn.GPTConfig(vocab_size=96, block_size=args.block, n_layer=4, n_head=N_HEAD, n_embd=args.n_embd)
    gpt = nn.GPT(config)
    model = tensor_parallelize(gpt, comm, sequence_parallel=args.sp) if t > 1 else gpt
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    layer = []
    first = model.h[0]
    first.register_forward_pre_hook(lambda m, a: layer.append(-comm.stats.bytes_sent))
    first.register_forward_hook(lambda m, a, o: layer.__setitem__(-1, layer[-1] + comm.stats.bytes_sent))
    rng = np.random.default_rng(0)
    times = []
    memory.reset_peak()
    for _ in range(args.steps):
        x = rng.integers(0, 96, (args.batch, args.block))
        comm.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    row = np.array([np.median(times[1:]), layer[-1], memory.peak()["activations"]], np.float64)
    rows = ring_all_gather(comm, row, total=3 * t).reshape(t, 3)
    if r == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"step": float(rows[:, 0].max()), "layer_bytes": float(rows[0, 1]),
                       "activations": float(rows[0, 2])}, f)


def launch(t, sp, args):
    from minitrain.testing import run_worker
    return run_worker(__file__, t, ["--steps", args.steps, "--n-embd", args.n_embd, "--block", args.block,
                                    "--batch", args.batch] + (["--sp"] if sp else []))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--tp", type=cli.positive_int, nargs="+", action=cli.Distinct, default=[1, 2, 4],
                    help="tensor-parallel sizes: one mpiexec launch each; tp=1, the speed-up's anchor, runs first "
                         "whether listed or not")
    ap.add_argument("--steps", type=cli.at_least(2, "the first step is not timed"), default=6,
                    help="steps, the first not timed (the median of the others is kept)")
    ap.add_argument("--n-embd", type=cli.positive_int, default=256, help="embedding width")
    ap.add_argument("--block", type=cli.positive_int, default=128, help="sequence length")
    ap.add_argument("--batch", type=cli.positive_int, default=8, help="sequences per step")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--sp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    if args.n_embd % N_HEAD:
        ap.error(f"argument --n-embd: must be a multiple of the {N_HEAD} heads, got {args.n_embd}")
    for t in args.tp:
        for what, n in ((f"the {N_HEAD} heads", N_HEAD), (f"--n-embd {args.n_embd}", args.n_embd),
                        (f"--block {args.block} (sequence parallelism splits it)", args.block)):
            if n % t:
                ap.error(f"argument --tp: {t} does not divide {what}")
    tps = [1] + [t for t in dict.fromkeys(args.tp) if t != 1]
    results = {}
    base = None
    from minitrain.testing import mpi_library_name
    print(f"MPI: {mpi_library_name()}")
    print(f"{'config':<10} {'step':>9} {'speed-up':>9} {'fwd bytes/layer':>16} {'formula':>10} {'peak activations':>17}")
    for t in tps:
        for sp in ((False, True) if t > 1 else (False,)):
            r = launch(t, sp, args)
            name = f"tp={t}" + ("+sp" if sp else "")
            results[name] = r
            base = base or r["step"]                       # tp=1: the first launch
            formula = 2 * 2 * (t - 1) / t * args.batch * args.block * args.n_embd * 4
            r["formula"] = formula
            print(f"{name:<10} {r['step'] * 1e3:>7.1f}ms {base / r['step']:>8.2f}x {r['layer_bytes'] / 2**20:>13.3f}MiB "
                  f"{formula / 2**20:>7.3f}MiB {r['activations'] / 2**20:>14.2f}MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

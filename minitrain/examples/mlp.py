"""The main job: an MLP trained on the real 8x8 digits.

    python -m minitrain.examples.mlp [--epochs 30] [--batch-size 64] [--json out.json]

Single process for now (data parallelism arrives with issue 4): under ``mpirun -n N`` rank 0
trains and the other ranks exit. Reports test accuracy, samples/s and memory by category.
"""
import argparse
import sys
import time

import numpy as np
from tqdm import tqdm

import minitrain
from minitrain import memory, nn, optim
from minitrain.data import DataLoader, load_digits
from minitrain.examples.common import launch_info, memory_table, persistent_memory, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 for adam, 0.1 for sgd")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="number of hidden layers")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the run's figures as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def evaluate(model, x, y):
    with minitrain.no_grad():
        logits = model(minitrain.Tensor(x))
    return float((logits.numpy().argmax(axis=1) == y).mean())


def main(argv=None):
    args = parse_args(argv)
    rank, launched = launch_info()
    if rank != 0:
        return 0
    minitrain.backend.limit_blas_threads()
    if launched > 1:
        print(f"note: {launched} ranks launched; data parallelism is not implemented yet, "
              f"so rank 0 trains alone and ranks 1..{launched - 1} exit.", flush=True)

    minitrain.set_default_dtype(np.dtype(args.dtype))
    minitrain.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits(seed=args.seed)
    model = nn.MLP([x_train.shape[1]] + [args.hidden] * args.layers + [10])
    if args.optimizer == "adam":
        opt = optim.Adam(model.parameters(), lr=args.lr or 1e-3)
    else:
        opt = optim.SGD(model.parameters(), lr=args.lr or 0.1, momentum=0.9)
    loader = DataLoader((x_train, y_train), args.batch_size, seed=args.seed)

    memory.reset_peak()
    steps, seen, persistent = 0, 0, {}
    bar = tqdm(total=args.epochs * len(loader), disable=args.no_progress, file=sys.stdout,
               desc="train", unit="step")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(minitrain.Tensor(xb)), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            persistent = persistent_memory()
            steps += 1
            seen += len(xb)
            bar.update(1)
            if steps % 10 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}", epoch=epoch)
    elapsed = time.perf_counter() - start
    bar.close()

    final_loss = loss.item()
    accuracy = evaluate(model, x_test, y_test)
    peak = memory.peak()
    report = {
        "world_size": 1,
        "strategy": "single",
        "num_params": model.num_parameters(),
        "final_loss": final_loss,
        "test_accuracy": accuracy,
        "samples_per_second": seen / elapsed,
        "steps": steps,
        "ranks": [{"rank": 0, "memory": {"persistent": persistent, "peak": peak}, "bytes_sent": 0}],
    }
    print(f"\nMLP {model.sizes} ({report['num_params']:,} parameters), {args.optimizer}, "
          f"{args.epochs} epochs, global batch {args.batch_size}, {args.dtype}")
    print(f"final loss {final_loss:.4f}   test accuracy {accuracy:.2%}   "
          f"{report['samples_per_second']:,.0f} samples/s   {elapsed:.1f} s")
    print("memory on rank 0 (model states at the optimizer step; peak over the run):")
    print(memory_table(persistent, peak))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

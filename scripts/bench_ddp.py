"""minitrain DDP vs PyTorch DDP (gloo, CPU), same models, ranks and threads, in one run.

    python scripts/bench_ddp.py [--ranks 1 2] [--steps 30] [--json out.json]

Both run under the same mpiexec with one BLAS thread per rank and 4 MiB buckets; PyTorch's processes meet over
gloo on 127.0.0.1. Models: "small" is the issue's reference MLP 784-128-127-126-125-124-123-10 with
global batch 128 (per-step overhead dominates); "large" is 1024-1024-1024-1024-10 with global batch
256 (compute dominates). Prints the median step time of each, the ratio minitrain / PyTorch, the
scaling from 1 to 2 ranks, and for minitrain the fraction of all-reduce time hidden behind backward
(1 - time spent waiting for buckets / time the bucket all-reduces took). A local-SGD row shows the
speed / staleness trade-off: step time and the training loss reached after the same steps.
"""
import argparse
import json
import time

import numpy as np

from minitrain import cli

LR = 0.05
BUCKET_CAP_MB = 4   # both frameworks; at the default 25 MiB the large model (16.8 MB) is one bucket,
                    # which cannot start before backward ends: nothing to overlap
MODELS = {"small": ([784, 128, 127, 126, 125, 124, 123, 10], 128),
          "large": ([1024, 1024, 1024, 1024, 10], 256)}


def data(sizes, batch, steps, seed=0):
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((sizes[0], sizes[-1]))
    xs = [rng.standard_normal((batch, sizes[0])).astype(np.float32) for _ in range(steps)]
    return [(x, (x @ teacher).argmax(1)) for x in xs]


def minitrain_worker(args, sizes, batch):
    import minitrain as mt
    from minitrain import nn, optim, trace
    from minitrain.comm import init
    from minitrain.parallel import DistributedDataParallel, LocalSGD
    comm = init()
    p, r = comm.size, comm.rank
    mt.manual_seed(0)
    model = nn.MLP(sizes)
    wrapped = (DistributedDataParallel(model, comm, bucket_cap_mb=BUCKET_CAP_MB) if args.sync_every == 1
               else LocalSGD(model, comm, sync_every=args.sync_every))
    opt = optim.SGD(model.parameters(), lr=LR)
    times, losses = [], []
    trace.enable(rank=r)
    for step, (x, y) in enumerate(data(sizes, batch, args.steps)):
        xb, yb = mt.Tensor(x[r::p]), y[r::p]
        comm.barrier()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(wrapped(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.sync_every > 1:
            wrapped.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    events = trace.events()
    waited = sum(e["end"] - e["start"] for e in events if e["name"] == "wait for buckets")
    reducing = sum(e["end"] - e["start"] for e in events if e["name"] == "ring_all_reduce")
    return comm.rank, times, losses, waited, reducing


def torch_worker(args, sizes, batch):
    import torch
    import torch.distributed as dist
    from minitrain.testing import close_gloo
    from minitrain.examples.common import launch_info
    rank, world = launch_info()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=BUCKET_CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times, losses = [], []
    for x, y in data(sizes, batch, args.steps):
        xb, yb = torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world])
        dist.barrier()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    close_gloo(dist)
    return rank, times, losses, 0.0, 0.0


def worker(args):
    sizes, batch = MODELS[args.model]
    fn = minitrain_worker if args.framework == "minitrain" else torch_worker
    rank, times, losses, waited, reducing = fn(args, sizes, batch)
    if rank == 0:
        warm = min(5, len(times) // 3)
        with open(args.worker_out, "w") as f:
            json.dump({"step": float(np.median(times[warm:])), "final_loss": float(np.mean(losses[-5:])),
                       "waited": waited, "reducing": reducing}, f)


def launch(framework, model, p, steps, sync_every=1):
    from minitrain.testing import free_port, run_worker
    return run_worker(__file__, p, ["--framework", framework, "--model", model, "--steps", steps,
                                    "--sync-every", sync_every, "--port", free_port()], timeout=1200)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.positive_int, nargs="+", action=cli.Distinct, default=[1, 2],
                    help="one mpiexec launch per p")
    ap.add_argument("--steps", type=cli.positive_int, default=30, help="timed steps per model")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--models", nargs="+", action=cli.Distinct, choices=list(MODELS), default=list(MODELS),
                    help="which models (local SGD runs on the last one)")
    ap.add_argument("--local-sgd", type=cli.positive_int, nargs="*", action=cli.Distinct, default=[1, 4, 8],
                    metavar="K",
                    help="local SGD: average every K steps (none: skip)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--framework", default="minitrain", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="small", help=argparse.SUPPRESS)
    ap.add_argument("--sync-every", type=cli.positive_int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=cli.nonneg_int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    if max(args.ranks) == 1 and args.local_sgd and "--local-sgd" in cli.given_options(ap, None):
        cli.refuse(ap, "--local-sgd", "--ranks 1", "local SGD averages the replicas of 2 or more ranks")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("the anchor is PyTorch's DistributedDataParallel: pip install -e '.[oracle]'") from None
    results = {}
    from minitrain.testing import mpi_library_name
    print(f"MPI: {mpi_library_name()}; PyTorch: gloo")
    print(f"{'model':<6} {'p':>2} {'minitrain':>11} {'pytorch':>11} {'ratio':>6} {'hidden comm':>12}")
    for model in args.models:
        for p in args.ranks:
            ours, theirs = launch("minitrain", model, p, args.steps), launch("torch", model, p, args.steps)
            hidden = 1 - ours["waited"] / ours["reducing"] if ours["reducing"] else float("nan")
            results[f"{model}/p{p}"] = {"minitrain": ours, "torch": theirs, "hidden_fraction": hidden}
            print(f"{model:<6} {p:>2} {ours['step'] * 1e3:>9.2f}ms {theirs['step'] * 1e3:>9.2f}ms "
                  f"{ours['step'] / theirs['step']:>5.2f}x {'' if p == 1 else f'{max(hidden, 0):>11.0%}'}")
        if 1 in args.ranks and 2 in args.ranks:
            for fw in ("minitrain", "torch"):
                one, two = results[f"{model}/p1"][fw]["step"], results[f"{model}/p2"][fw]["step"]
                print(f"       scaling 1 -> 2 ranks ({fw}): step of the same global batch {one * 1e3:.2f} -> "
                      f"{two * 1e3:.2f} ms, speed-up x{one / two:.2f} (2 ranks share 2 cores)")
    p = max(args.ranks)
    if p > 1 and args.local_sgd:
        steps, model = 2 * args.steps, args.models[-1]
        print(f"\nlocal SGD on '{model}', p={p}: speed vs staleness after {steps} steps (loss: mean of the last 5)")
        for every in args.local_sgd:
            r = launch("minitrain", model, p, steps, every)
            results[f"local_sgd/{every}"] = r
            print(f"  sync every {every}: step {r['step'] * 1e3:7.2f} ms, training loss {r['final_loss']:.4f}"
                  + ("  (= DDP)" if every == 1 else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

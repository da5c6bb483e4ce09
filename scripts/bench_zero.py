"""DDP vs ZeRO-1/2/3 (and ZeRO-Offload): step time, bytes sent and model-state memory per rank,
measured beside the ZeRO paper's formulas, in one run; PyTorch's DDP and ZeroRedundancyOptimizer
(gloo, CPU) are the speed anchor.

    python scripts/bench_zero.py [--ranks 2 4] [--steps 20] [--plot zero_memory.png] [--json out.json]

Model: MLP 1024-1024-1024-1024-10 (3.16 M parameters, fp32 Adam: 16 bytes per parameter under
DDP), global batch 256, one BLAS thread per rank, every configuration under its own mpiexec.
Columns: median step time, its ratio to minitrain's DDP and to PyTorch's DDP (same p), bytes each
rank sends per step against 2Ψ(p-1)/p·4 (DDP, ZeRO-1/2) or 3Ψ(p-1)/p·4 (ZeRO-3), and the device
model states at the optimizer step against (4 + 4 + 8)Ψ split by stage. At p=4 the 2 cores are
oversubscribed: compare times within a row, not across p. With fp32 parameters the offloaded
optimizer keeps a host master copy of the shard (4Ψ/N more on the host, none on the device).
"hidden": the share of the step's asynchronous collectives' time the step did not wait for (DDP's
bucket all-reduces behind backward; ZeRO-3 (FSDP): the all-gathers prefetched behind the previous
unit's forward, the reduce-scatters behind backward): 1 - time waiting for them / time they took,
read off the trace's spans over the timed steps (a collective its waiter runs counts as waited).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from minitrain import cli

SIZES, BATCH, LR = [1024, 1024, 1024, 1024, 10], 256, 1e-3
WARMUP = 3                  # steps before the timed ones (allocation, the first all-gathers)
CONFIGS = ["ddp", "zero1", "zero2", "zero3", "zero2+offload", "zero3+offload"]
ANCHORS = ["torch_ddp", "torch_zero1"]


def data(steps, seed=0):
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((SIZES[0], SIZES[-1]))
    xs = [rng.standard_normal((BATCH, SIZES[0])).astype(np.float32) for _ in range(steps)]
    return [(x, (x @ teacher).argmax(1)) for x in xs]


def minitrain_worker(args):
    import minitrain as mt
    from minitrain import memory, nn, optim, trace
    from minitrain.comm import init, ring_all_gather
    from minitrain.parallel import (CPUOffloadOptimizer, DistributedDataParallel, FullyShardedDataParallel,
                                    ZeroRedundancyOptimizer)
    comm = init()
    p, r = comm.size, comm.rank
    mt.manual_seed(0)
    model = nn.MLP(SIZES)
    name, offload = args.config.split("+")[0], "+offload" in args.config
    if name == "ddp":
        forward, opt = DistributedDataParallel(model, comm, bucket_cap_mb=4), optim.Adam(model.parameters(), lr=LR)
    elif name in ("zero1", "zero2"):
        forward = model
        opt = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, comm, stage=int(name[-1]), bucket_cap_mb=4,
                                      offload=offload, lr=LR)
    else:
        forward = FullyShardedDataParallel(model, comm, offload_params=offload)
        opt = (CPUOffloadOptimizer if offload else optim.Adam)(
            *([forward.parameters(), optim.Adam] if offload else [forward.parameters()]), lr=LR)
    times, persistent, host = [], None, None
    for step, (x, y) in enumerate(data(args.steps)):
        if step == WARMUP:
            trace.enable(rank=r)                     # the spans of the timed steps: what was hidden
        comm.barrier()
        sent = comm.stats.bytes_sent
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(forward(mt.Tensor(x[r::p])), y[r::p]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        step_bytes = comm.stats.bytes_sent - sent
        if persistent is None:
            persistent, host = memory.snapshot(), memory.host_snapshot()
    peak = memory.peak()
    waited, took = hidden_spans(trace.events() if trace.tracer().enabled else [])
    row = np.array([np.median(times[WARMUP:]), step_bytes, persistent["params"], persistent["grads"],
                    persistent["optimizer_state"], host["params"] + host["grads"] + host["optimizer_state"],
                    peak["total"], waited, took], np.float64)
    rows = ring_all_gather(comm, row, total=row.size * p).reshape(p, -1)
    if r == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"step": float(np.max(rows[:, 0])), "bytes": rows[:, 1].tolist(),
                       "params": rows[:, 2].tolist(), "grads": rows[:, 3].tolist(),
                       "optimizer_state": rows[:, 4].tolist(), "host": rows[:, 5].tolist(),
                       "peak": rows[:, 6].tolist(), "psi": model.num_parameters(),
                       "hidden_fraction": [1 - w / t if t and name in ("ddp", "zero3") else None
                                           for w, t in rows[:, 7:9].tolist()]}, f)


def hidden_spans(events):
    """(seconds waiting for the asynchronous collectives, seconds they took) in the trace's spans."""
    waits = [e for e in events if e["name"] in ("wait for buckets", "wait for reduce-scatter")
             or e["name"].startswith("all-gather ")]
    took = [e for e in events if e["name"] in ("ring_all_reduce", "ring_all_gather", "ring_reduce_scatter")]
    return sum(e["end"] - e["start"] for e in waits), sum(e["end"] - e["start"] for e in took)


def torch_worker(args):
    import torch
    import torch.distributed as dist
    from minitrain.testing import close_gloo
    from minitrain.examples.common import launch_info
    rank, world = launch_info()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(SIZES) - 2 else [])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=4)
    if args.config == "torch_zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    times = []
    for x, y in data(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x[rank::world])),
                                          torch.from_numpy(y[rank::world])).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    step = torch.tensor([float(np.median(times[3:]))])
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"step": float(step[0])}, f)
    close_gloo(dist)


def launch(config, p, steps):
    from minitrain.testing import free_port, run_worker
    return run_worker(__file__, p, ["--config", config, "--steps", steps, "--port", free_port()])


def formulas(config, psi, p):
    from minitrain.parallel.zero_memory import FP32_ADAM, model_state_bytes
    name = config.split("+")[0]
    stage = 0 if name == "ddp" else int(name[-1])
    states = model_state_bytes(psi, p, stage, **FP32_ADAM)
    traffic = (3 if stage == 3 else 2) * (p - 1) / p * psi * 4
    device = states["total"]          # what stays on the device: --offload moves the optimizer state
    if "offload" in config:           # (and under ZeRO-3 the parameter and gradient shards) to the host
        device -= states["optimizer_state"] + (states["params"] + states["grads"] if stage == 3 else 0)
    return states, traffic, device


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ps = sorted({int(k.split("/p")[1]) for k in results})
    fig, axes = plt.subplots(1, len(ps), figsize=(6 * len(ps), 4), squeeze=False)
    for ax, p in zip(axes[0], ps):
        names = [c for c in CONFIGS if f"{c}/p{p}" in results]
        bottom = np.zeros(len(names))
        for category, colour in (("params", "C0"), ("grads", "C1"), ("optimizer_state", "C2"), ("host", "C7")):
            values = np.array([results[f"{c}/p{p}"][category][0] for c in names]) / 2 ** 20
            ax.bar(names, values, bottom=bottom, color=colour, label=category + (" (offloaded)" if category == "host" else ""))
            bottom += values
        formula = [formulas(c, results[f"{c}/p{p}"]["psi"], p)[2] / 2 ** 20 for c in names]
        ax.plot(names, formula, "k_", markersize=30, mew=2, label="ZeRO formula (device)")
        ax.set_title(f"model states per rank, p = {p} (rank 0, measured)")
        ax.set_ylabel("MiB")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.at_least(2, "ZeRO shards over 2 or more ranks: one holds the whole model, sends nothing"),
                    nargs="+", action=cli.Distinct, default=[2, 4],
                    help="one mpiexec launch per p and configuration")
    ap.add_argument("--steps", type=cli.at_least(WARMUP + 1, f"the first {WARMUP} are warm-up, not timed"), default=20,
                    help=f"steps, the first {WARMUP} not timed (the median of the others is kept)")
    ap.add_argument("--configs", nargs="+", action=cli.Distinct, default=CONFIGS + ANCHORS, metavar="CONFIG",
                    choices=CONFIGS + ANCHORS,
                    help=f"any of {', '.join(CONFIGS + ANCHORS)} (default: all of them; the torch_ anchors where "
                         f"PyTorch is installed)")
    ap.add_argument("--plot", metavar="PNG", type=cli.output_image, help="draw model-state memory per rank (default: no plot)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=cli.nonneg_int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return (torch_worker if args.config.startswith("torch") else minitrain_worker)(args)
    try:
        import torch  # noqa: F401
    except ImportError:
        asked = [c for c in args.configs if c in ANCHORS]
        if "--configs" in cli.given_options(ap, sys.argv[1:]) and asked:
            ap.error(f"argument --configs: {', '.join(asked)} run(s) PyTorch, which is not installed "
                     f"(pip install -e '.[oracle]')")
        args.configs = [c for c in args.configs if c not in ANCHORS]
    results = {}
    for p in args.ranks:
        runs = {c: launch(c, p, args.steps) for c in args.configs}
        results.update({f"{c}/p{p}": r for c, r in runs.items()})
        ddp = runs.get("ddp", {}).get("step")
        anchor = runs.get("torch_ddp", {}).get("step")
        print(f"\np = {p}: {'config':<14} {'step':>9} {'/ddp':>6} {'/torch ddp':>10} {'sent/step':>10} "
              f"{'formula':>10} {'device states':>14} {'formula':>10} {'host':>9} {'peak':>9} {'hidden':>7}")
        for c, r in runs.items():
            line = f"       {c:<14} {r['step'] * 1e3:>7.1f}ms " + (f"{r['step'] / ddp:>5.2f}x " if ddp else " " * 7)
            line += f"{r['step'] / anchor:>9.2f}x " if anchor else " " * 11
            if "psi" in r:
                _, traffic, formula_device = formulas(c, r["psi"], p)
                device = r["params"][0] + r["grads"][0] + r["optimizer_state"][0]
                line += (f"{r['bytes'][0] / 2**20:>8.2f}Mi {traffic / 2**20:>8.2f}Mi {device / 2**20:>12.2f}Mi "
                         f"{formula_device / 2**20:>8.2f}Mi {r['host'][0] / 2**20:>7.2f}Mi {r['peak'][0] / 2**20:>7.2f}Mi")
                hidden = [h for h in r["hidden_fraction"] if h is not None]
                line += f" {min(hidden):>6.0%}" if hidden else ""
            print(line)
    from minitrain.testing import mpi_library_name
    print(f"\nMPI: {mpi_library_name()}; PyTorch anchors: gloo")
    print("\n(step: slowest rank's median; device states: params + grads + optimizer state on rank 0 at the first "
          "step;\n formula: the ZeRO paper's (4 + 4 + 8)Ψ split by stage, minus what --offload moves to the host; "
          "peak: everything, gathered units and buffers included)")
    if args.plot:
        plot(results, args.plot)
        print(f"memory bars: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

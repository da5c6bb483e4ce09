"""The main job's pipeline strategy (python -m minitrain.examples.mlp --strategy pipeline):

    mpirun -n 4 python -m minitrain.examples.mlp --strategy pipeline --schedule 1f1b --microbatches 8
        [--chunks V] [--dp D] [--json out.json] [--plot pipeline.png]

The MLP's layers are cut into ranks/D stages (x chunks); D data-parallel replicas of the pipeline
each take 1/D of every global batch and average their gradients once per step. Rank 0 reports the
measured bubble (from the trace of the last step: 1 - time in forward/backward / step time) beside
the formula, and --plot draws the simulated timeline (the schedule run with the measured mean
forward and backward times) above the measured one.
"""
import sys
import time

import numpy as np

import minitrain
from minitrain import comm as mtcomm
from minitrain import memory, nn, optim, trace
from minitrain.checkpoint import CheckpointError
from minitrain.comm import DeviceMesh, MeshError
from minitrain.data import DataLoader, DistributedSampler, load_digits
from minitrain.examples import checkpointing
from minitrain.examples.common import (device_code, device_name, fmt_bytes, mpi_line, planner_line, tqdm,
                                       transport_name, write_json)
from minitrain.examples.mlp import layout, nothing_left
from minitrain.parallel.pipeline import PipelineParallel, simulate


def _fail(parser, comm, message):
    if comm.rank == 0:
        parser.error(message)
    sys.exit(2)


def main_pipeline(args, parser, comm):
    world, rank = comm.size, comm.rank
    if args.precision not in ("fp32", "fp64"):
        _fail(parser, comm, "--strategy pipeline runs in fp32 or fp64 (mixed precision is wired into ZeRO and DDP)")
    if world % args.dp:
        _fail(parser, comm, f"--dp {args.dp} does not divide the {world} ranks into pipelines")
    pp = world // args.dp
    if args.batch_size % (args.dp * args.microbatches):
        _fail(parser, comm, f"--batch-size {args.batch_size} is not divisible into {args.dp} replica(s) x "
                            f"{args.microbatches} micro-batches")
    if args.layers + 1 < pp * args.chunks:
        _fail(parser, comm, f"--layers {args.layers} gives {args.layers + 1} Linear layers, fewer than the "
                            f"{pp * args.chunks} pipeline stages (ranks/dp x chunks)")
    try:
        mesh = DeviceMesh(comm, dp=args.dp, pp=pp)
    except MeshError as e:
        _fail(parser, comm, str(e))
    pp_comm, dp_comm = mesh.comm("pp"), mesh.comm("dp")
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    minitrain.manual_seed(args.seed)                 # every rank builds the same model, keeps its stages
    x_train, y_train, x_test, y_test = load_digits(seed=args.seed)
    sizes = [x_train.shape[1]] + [args.hidden] * args.layers + [10]
    model = nn.MLP(sizes)
    psi = model.num_parameters()
    try:
        pipe = PipelineParallel(model, pp_comm, args.schedule, args.microbatches, chunks=args.chunks,
                                dp_comm=dp_comm)
    except ValueError as e:
        _fail(parser, comm, str(e))
    opt = (optim.Adam(pipe.parameters(), lr=args.lr or 1e-3) if args.optimizer == "adam"
           else optim.SGD(pipe.parameters(), lr=args.lr or 0.1, momentum=0.9))
    local_batch = args.batch_size // args.dp
    sampler = DistributedSampler(len(x_train), dp_comm.rank, args.dp, seed=args.seed)
    loader = DataLoader((x_train, y_train), local_batch, sampler=sampler)
    ckpt = checkpointing.Checkpointer(args, comm, pipe, opt, layout=layout(args, world, 0),
                                      extra=lambda: {"loader": loader.state_dict()})
    try:
        loaded = ckpt.resume()
    except CheckpointError as e:
        return checkpointing.fail(comm, e)
    first_step = 0 if loaded is None else loaded.step
    if loaded is not None:
        loader.load_state_dict(loaded.extra["loader"])
    bar = tqdm(total=args.epochs * len(loader), initial=first_step, disable=args.no_progress or rank != 0,
               file=sys.stdout, desc=f"{args.schedule} x{pp}" + (f" (dp {args.dp})" if args.dp > 1 else ""), unit="step")
    trace.enable(rank=rank)
    memory.reset_peak()
    comm.barrier()
    start = time.perf_counter()
    steps = seen = 0
    step_times = []
    losses = []
    for epoch in range(loader.sampler.epoch, args.epochs):      # resumed: from the checkpoint's epoch
        loader.set_epoch(epoch)
        for xb, yb in loader:
            if len(yb) != local_batch:
                continue                             # a short last batch would not split into micro-batches
            trace.tracer().events.clear()            # keep the last step's trace only
            started, cpu_started = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            loss = pipe.train_step(xb, yb, nn.functional.cross_entropy)
            opt.step()
            step_times.append((time.perf_counter() - started, time.thread_time() - cpu_started))
            steps += 1
            seen += len(yb)
            losses.append(loss)
            ckpt.after_step(first_step + steps)
            bar.update(1)
            if steps % 10 == 0:
                bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch)
    elapsed = time.perf_counter() - start
    bar.close()
    ckpt.finish(first_step + steps)
    if steps == 0:
        return nothing_left(args, comm, first_step)
    # the global loss of each step: the replicas' mean (each pipeline's ranks all hold their replica's)
    losses = [float(v) for v in mtcomm.ring_all_gather(comm, np.asarray(losses, np.float64), total=world * steps)
              .reshape(world, steps).mean(axis=0)]
    events = list(trace.events())
    bubbles = np.asarray(pipe.measured_bubble_fraction(events))        # over this pipeline's ranks
    all_events = trace.gather_events(comm)
    sent = float(mtcomm.ring_all_gather(comm, np.array([(pp_comm.stats.bytes_sent + dp_comm.stats.bytes_sent) / max(steps, 1)]), total=world)[0])
    devices = [device_name(c) for c in mtcomm.ring_all_gather(comm, np.array([float(device_code())]), total=world)]
    peak = memory.peak()                             # per rank: every category, and its median step
    wall, cpu = np.array(step_times).T
    mine = np.array([*(peak[c] for c in memory.CATEGORIES), peak["total"], np.median(cpu), np.min(wall),
                     np.median(wall)], np.float64)
    table = mtcomm.ring_all_gather(comm, mine, total=mine.size * world).reshape(world, -1)
    state = pipe.full_state_dict()                   # every rank: the whole model, to evaluate it
    if rank != 0:
        return 0
    full = nn.MLP(sizes)
    full.load_state_dict(state)
    with minitrain.no_grad():
        accuracy = float((full(minitrain.Tensor(x_test)).numpy().argmax(1) == y_test).mean())
    formula = pipe.formula_bubble_fraction()
    print(f"\nMLP {sizes} ({psi:,} parameters), {args.schedule} over {pp} stages x {args.chunks} chunk(s)"
          + (f", {args.dp} data-parallel replicas" if args.dp > 1 else "") + f", {args.microbatches} micro-batches")
    print(f"final loss {loss:.4f}   test accuracy {accuracy:.2%}   {seen * args.dp / elapsed:,.0f} samples/s   "
          f"{elapsed:.1f} s   rank 0 sends {fmt_bytes(sent)}/step")
    print(f"devices by rank: {', '.join(devices)} ({minitrain.backend.describe_device()} on rank 0, "
          f"transport {transport_name(comm)})")
    print(f"bubble, last step: measured {', '.join(f'{b:.3f}' for b in bubbles)} (per rank), formula "
          f"(p-1)/(v·m+p-1) = {formula:.3f}")
    print(f"MPI: {mpi_line()}; check_collectives on, stall threshold {args.comm_timeout:g} s")
    print(planner_line(args, world, float(table[:, -1].max()), table[:, -4].max()))
    report = {"world_size": world, "mpi_library": mpi_line(), "comm_timeout": args.comm_timeout, "strategy": "pipeline",
              "transport": transport_name(comm), "num_params": psi, "final_loss": loss,
              "test_accuracy": accuracy, "samples_per_second": seen * args.dp / elapsed, "steps": steps,
              "first_step": first_step, "losses": losses,
              "pipeline": {"schedule": args.schedule, "num_stages": pp, "num_microbatches": args.microbatches,
                           "chunks": args.chunks, "dp": args.dp,
                           "measured_bubble_fraction": float(np.mean(bubbles)),
                           "measured_bubble_fraction_per_rank": bubbles.tolist(),
                           "formula_bubble_fraction": formula},
              "step_time_s": float(table[:, -1].max()), "step_time_min_s": float(table[:, -2].max()),
              "step_cpu_time_s": float(table[:, -3].max()),
              "ranks": [{"rank": r, "device": devices[r],
                         "memory": {"peak": dict(zip(list(memory.CATEGORIES) + ["total"], map(int, v[:-3])))}}
                        for r, v in enumerate(table)]}
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot_pipeline(pipe, all_events, args.plot, pp)
    return 0


def plot_pipeline(pipe, all_events, path, pp):
    """The schedule simulated with the measured mean forward / backward times, above the measured
    timeline of the last step (ranks of the first pipeline)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = [e for e in all_events if e["rank"] < pp and e.get("args", {}).get("op")]
    mean = {k: float(np.mean([e["end"] - e["start"] for e in ops if e["args"]["op"] == k]) or 1e-3) for k in "FB"}
    sim = simulate(pipe.schedule, mean["F"], mean["B"])
    simulated = [{"rank": s, "name": str(a), "kind": "compute", "start": start, "end": end}
                 for s, row in enumerate(sim["timeline"]) for a, start, end in row]
    colors = {}
    palette = plt.get_cmap("tab20")
    for e in simulated + ops:
        op, mb = e["name"][0], int(e["name"][1:].split(".")[0])
        colors[e["name"]] = palette((2 * mb + (op == "B")) % 20)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 1.5 + 1.0 * pp), sharex=True)
    from minitrain import trace as tr
    tr.plot_timeline(simulated, ax=top, colors=colors, legend=False,
                     title=f"simulated {pipe.schedule_name}: bubble {sim['bubble_fraction']:.3f} "
                           f"(formula {pipe.formula_bubble_fraction():.3f})")
    tr.plot_timeline(ops, ax=bottom, colors=colors, title="measured (last step)", legend=False)
    # one entry per micro-batch and direction (F i: forward of micro-batch i, B i: its backward), beside the axes
    batches = sorted({int(e["name"][1:].split(".")[0]) for e in simulated})
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette((2 * mb + (op == "B")) % 20)) for mb in batches for op in "FB"]
    top.legend(handles, [f"{op} {mb}" for mb in batches for op in "FB"], fontsize=7, ncol=2, title="micro-batch",
               title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

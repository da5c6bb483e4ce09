"""The main job's pipeline strategy (python -m minitrain.examples.mlp --strategy pipeline):

    mpirun -n 4 python -m minitrain.examples.mlp --strategy pipeline --schedule 1f1b --microbatches 8
        [--chunks V] [--dp D] [--layers L] [--json out.json] [--plot pipeline.png] [--trace trace.json]

The MLP's layers are cut into ranks/D stages (x chunks), balanced by counted cost (F + B + W
multiply-adds per row, from the parameters per layer: partition.py); by default the MLP has
max(2, stages) hidden layers, so any -n works, and the table at the start names each stage's
layers and cost share (an uneven cut is reported with the bubble it implies). D data-parallel
replicas of the pipeline each take 1/D of every global batch (uneven where D or the micro-batches
do not divide it: each micro-batch's loss is weighted by its rows). At the end rank 0 reports the
measured bubble (measure.py: per rank, the step's time outside its own F/B/W work over the step's
wall time, mean over ranks and over the full batches after the first) beside the formula, with the
residual per cause; --plot draws the schedule simulated with the measured F, B, W times above the
measured last step, on one time axis.
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
from minitrain.examples.common import checks_line, device_code, mpi_line, part_of_job, tqdm, transport_name
from minitrain.examples.mlp_common import layout, nothing_left
from minitrain.examples.mlp_report import speed_text
from minitrain.examples.report import (StepWatch, device_name, fmt_bytes, gather_steps, plan_comparison,
                                       show_plan, write_json)
from minitrain.parallel.pipeline import PipelineParallel, implied_bubble, simulate
from minitrain.parallel.pipeline.partition import format_stage_table
from minitrain.parallel.pipeline.schedules import default_chunks
from minitrain.plan.layout import empty_microbatches


def _fail(parser, comm, message):
    if comm.rank == 0:
        parser.error(message)
    sys.exit(2)


def main_pipeline(args, parser, comm):
    world, rank = comm.size, comm.rank
    if world % args.dp:
        _fail(parser, comm, f"--dp {args.dp} does not divide the {world} ranks into pipelines")
    pp = world // args.dp
    empty = empty_microbatches(args.microbatches, args.batch_size, args.dp)
    if empty:
        _fail(parser, comm, empty)
    try:
        chunks = default_chunks(args.schedule, args.chunks)
    except ValueError as e:
        _fail(parser, comm, str(e))
    layers = max(2, pp * chunks) if args.layers is None else args.layers
    args.chunks, args.layers = chunks, layers        # resolved: the checkpoint's layout and the planner see them
    if layers + 1 < pp * chunks:
        _fail(parser, comm, f"--layers {layers} gives {layers + 1} Linear layers, fewer than the "
                            f"{pp * chunks} pipeline stages (ranks/dp x chunks)")
    try:
        mesh = DeviceMesh(comm, dp=args.dp, pp=pp)
    except MeshError as e:
        _fail(parser, comm, str(e))
    pp_comm, dp_comm = mesh.comm("pp"), mesh.comm("dp")
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    minitrain.manual_seed(args.seed)                 # every rank builds the same model, keeps its stages
    x_train, y_train, x_test, y_test = load_digits(seed=args.split_seed)
    sizes = [x_train.shape[1]] + [args.hidden] * layers + [10]
    model = nn.MLP(sizes)
    psi = model.num_parameters()
    try:
        pipe = PipelineParallel(model, pp_comm, args.schedule, args.microbatches, chunks=chunks, dp_comm=dp_comm)
    except ValueError as e:
        _fail(parser, comm, str(e))
    counted = [row["cost"] for row in pipe.stage_rows]
    implied = implied_bubble(pipe.schedule, counted)
    equal = implied_bubble(pipe.schedule, [1.0] * len(counted))
    if rank == 0:
        print(f"MLP {sizes} ({psi:,} parameters), {args.schedule} over {pp} stages x {chunks} chunk(s)"
              + (f", {args.dp} data-parallel replicas" if args.dp > 1 else "") + f", {args.microbatches} micro-batches")
        print(format_stage_table(pipe.stage_rows, formula=equal, implied=implied))
    opt = (optim.Adam(pipe.parameters(), lr=1e-3 if args.lr is None else args.lr) if args.optimizer == "adam"
           else optim.SGD(pipe.parameters(), lr=0.1 if args.lr is None else args.lr, momentum=0.9))
    sampler = DistributedSampler(len(x_train), num_replicas=args.dp, rank=dp_comm.rank, seed=args.seed)
    loader = DataLoader((x_train, y_train), args.batch_size, sampler=sampler, global_batch=True)
    ckpt = checkpointing.Checkpointer(args, comm, pipe, opt, layout=layout(args, world, 0),
                                      **checkpointing.data_loader(loader))
    try:
        first_step = ckpt.start_step()
    except CheckpointError as e:
        return checkpointing.fail(comm, e)
    bar = tqdm(total=args.epochs * len(loader), initial=first_step, disable=args.no_progress or rank != 0,
               file=sys.stdout, desc=f"{args.schedule} x{pp}" + (f" (dp {args.dp})" if args.dp > 1 else ""), unit="step")
    watch = StepWatch(rank, keep="last")             # the last step's trace (the runtime keeps a summary)
    memory.reset_peak()
    comm.barrier()
    start = time.perf_counter()
    steps = 0
    losses = []
    for epoch in range(loader.sampler.epoch, args.epochs):      # resumed: from the checkpoint's epoch
        loader.set_epoch(epoch)
        for xb, yb in loader:
            with watch.step(counted=loader.global_rows == args.batch_size):    # a short last batch: out of the step figures
                opt.zero_grad()
                loss = pipe.train_step(xb, yb, nn.functional.cross_entropy, global_rows=loader.global_rows)
                opt.step()
            steps += 1
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
    final_loss = losses[-1]                          # the global batch's, not this rank's replica's share
    summary = pipe.measured_bubble(global_rows=args.batch_size)   # this pipeline's ranks, its full batches
    if args.trace:
        trace.save_chrome(args.trace, comm)
    all_events = trace.gather_events(comm)
    sent = float(mtcomm.ring_all_gather(comm, np.array([(pp_comm.stats.bytes_sent + dp_comm.stats.bytes_sent)
                                                        / max(steps, 1)]), total=world)[0])
    devices = [device_name(c) for c in mtcomm.ring_all_gather(comm, np.array([float(device_code())]), total=world)]
    peak = memory.peak()                             # per rank: every category
    mine = np.array([*(peak[c] for c in memory.CATEGORIES), peak["total"]], np.float64)
    table = mtcomm.ring_all_gather(comm, mine, total=mine.size * world).reshape(world, -1)
    step_by_rank, slowest = gather_steps(comm, watch.timer)
    # the test set through each pipeline's stages, forward only (no rank gathers the model); its last stage
    # has the outputs, and gives rank 0's pipeline its accuracy
    logits, _ = pipe.eval_step(x_test)
    logits = None if logits is None else minitrain.backend.to_host(logits)
    correct = np.array([0.0 if logits is None else float((logits.argmax(1) == y_test).mean())])
    accuracy = float(mtcomm.broadcast(pp_comm, correct, root=pipe.loss_rank)[0])
    row_of_rank = {r: s for s, r in enumerate(mesh.ranks_along("pp"))}   # rank 0's pipeline
    if rank != 0:
        return 0
    formula = summary["formula_bubble_fraction"]
    samples = args.batch_size / slowest["step_time_s"] if slowest["step_time_s"] else 0.0
    print(f"\nfinal loss {final_loss:.4f}   test accuracy {accuracy:.2%}   {speed_text(samples)}   "
          f"{elapsed:.1f} s   rank 0 sends {fmt_bytes(sent)}/step")
    print(f"devices by rank: {', '.join(devices)} ({minitrain.backend.describe_device()} on rank 0, "
          f"transport {transport_name(comm)})")
    low, high = summary["measured_bubble_fraction_spread"]
    short = f", {summary['steps_left_out']} short batch(es) left out" if summary["steps_left_out"] else ""
    print(f"bubble (mean over ranks, {summary['steps_measured']} steps after the first{short}; "
          f"per step {low:.3f}..{high:.3f}): "
          f"measured {summary['measured_bubble_fraction']:.3f}   formula {formula:.3f}   simulated with each action's "
          f"measured time and the message costs (latency {summary['message_cost_s'] * 1e3:.2f} ms, send "
          f"{summary['message_send_overhead_s'] * 1e3:.2f} ms, receive {summary['message_receive_overhead_s'] * 1e3:.2f} ms) "
          f"{summary['simulated_bubble_fraction']:.3f}   first step {summary['first_step_bubble_fraction']:.3f}")
    print("  per rank: " + ", ".join(f"{b:.3f}" for b in summary["measured_bubble_fraction_per_rank"])
          + f"; step {summary['step_time_s'] * 1e3:.2f} ms measured (median), "
            f"{summary['simulated_step_time_s'] * 1e3:.2f} ms simulated")
    print("  measured - formula, by cause (fraction of the step): " + ", ".join(
        f"{k} {v:+.3f}" for k, v in summary["residual_by_cause"].items()))
    print(f"MPI: {mpi_line()}; {checks_line(args)}; {progress_line(pipe.progress)}")
    compared = plan_comparison(args, world, slowest, table[:, -1].max())
    show_plan(args, compared)
    report = {"world_size": world, "mpi_library": mpi_line(), "comm_timeout": args.comm_timeout, "check_collectives": args.check_collectives, "strategy": "pipeline",
              "transport": transport_name(comm), "num_params": psi, "final_loss": final_loss,
              "test_accuracy": accuracy, "samples_per_second": samples, "steps": steps, "elapsed_seconds": elapsed,
              "steady_state": watch.steady_state(), "planner": compared,
              "first_step": first_step, "losses": losses,
              "pipeline": {"schedule": args.schedule, "num_stages": pp, "num_microbatches": args.microbatches,
                           "chunks": chunks, "dp": args.dp, "layers": layers,
                           "stages": pipe.stage_rows, "implied_bubble_fraction": implied,
                           "progress_thread": pipe.progress.enabled,
                           "messages_move_without_sender": pipe.progress.probed, **summary},
              **slowest, "blas_threads": minitrain.backend.blas_threads(),
              "ranks": [{"rank": r, "device": devices[r],
                         "memory": {"peak": dict(zip(list(memory.CATEGORIES) + ["total"], map(int, v)))},
                         "step": step_by_rank[r]} for r, v in enumerate(table)]}
    if args.json:
        write_json(args.json, report)
    if args.plot:
        from minitrain.parallel.pipeline.timeline import plot_pipeline
        costs = summary["stage_seconds"]
        sim = simulate(pipe.schedule, costs["F"], costs["B"], costs["W"], message_cost=summary["message_cost_s"],
                       send_overhead=summary["message_send_overhead_s"],
                       receive_overhead=summary["message_receive_overhead_s"])
        plot_pipeline(pipe.schedule, sim, all_events, row_of_rank, args.plot,
                      title_sim=f"simulated {args.schedule} (measured F, B, W per stage and message costs): bubble "
                                f"{sim['bubble_fraction']:.3f}, formula {formula:.3f}",
                      title_measured=f"measured, last step: bubble {summary['measured_bubble_fraction_per_step'][-1]:.3f} "
                                     f"(mean over steps {summary['measured_bubble_fraction']:.3f})")
    return 0


def progress_line(progress):
    """What moves the pipeline's messages while a rank computes (progress.py)."""
    return f"pipeline progress thread {'on' if progress.enabled else 'off'} ({progress.why})"


if __name__ == "__main__":
    sys.exit(part_of_job("mlp_pipeline", "mpirun -n N python -m minitrain.examples.mlp --strategy pipeline ..."))

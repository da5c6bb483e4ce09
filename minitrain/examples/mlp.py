"""The main job: an MLP trained on the real 8x8 digits, data-parallel over every rank.

    mpirun -n 4 python -m minitrain.examples.mlp [--strategy ddp|local_sgd|zero1|zero2|zero3]
        [--precision fp32|fp64|fp16|bf16] [--offload] [--device-memory BYTES] [--batch-size 64]
        [--json out.json] [--trace trace.json] [--plot step.png] [--save-dir DIR --save-every N --resume]

Each rank trains on its DistributedSampler share of every global batch (--batch-size is
global; shares differ by a row where the ranks do not divide it, and the last batch of an epoch
is partial: nothing is padded or dropped), its mean loss weighted by its rows over the global
batch's (share_loss), and DDP averages the gradients, so N ranks take exactly the steps one
process would take on the whole batch. Rank 0 shows the progress bar and, at the end, a table per rank:
samples/s, compute vs communication time, bytes sent (beside the ring formula), memory.
--save-dir/--save-every/--resume: sharded checkpoints, resumable on any layout
(minitrain/examples/checkpointing.py); the JSON's losses are the global loss of every step run.
"""
import sys
import time

import numpy as np

import minitrain
from minitrain import comm as mtcomm
from minitrain import backend, cli, memory, nn, optim, trace
from minitrain.backend import LOW_PRECISION, bfloat16
from minitrain.checkpoint import CheckpointError
from minitrain.data import DataLoader, DistributedSampler, load_digits, share_loss, split_sizes
from minitrain.examples import checkpointing
from minitrain.examples.common import (StepTimer, device_code, device_name, fmt_bytes, gather_steps, init_comm,
                                       job_parser, memory_table, mpi_line, parse_job_args, persistent_memory,
                                       planner_line, tqdm, transport_name, write_json)
from minitrain.examples.options import refuse_unsupported
from minitrain.parallel import (CPUOffloadOptimizer, DistributedDataParallel, FullyShardedDataParallel, LocalSGD,
                                ZeroRedundancyOptimizer, check_replicas_equal, checkpoint_sequential,
                                found_inf_on_any_rank, offload_activations)
from minitrain.parallel.pipeline import NAMES as PIPELINE_NAMES
from minitrain.parallel.zero_memory import model_state_bytes

STRATEGIES = ("ddp", "local_sgd", "zero1", "zero2", "zero3", "pipeline")
PRECISIONS = {"fp32": np.float32, "fp64": np.float64, "fp16": np.float16, "bf16": bfloat16}


def parse_args(argv=None):
    p = job_parser(__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="how the ranks share the work")
    p.add_argument("--sync-every", type=cli.positive_int, default=4, help="local_sgd: average parameters every N steps")
    p.add_argument("--device-memory", type=cli.positive_int, default=None, metavar="BYTES",
                   help="teaching device: each rank may hold at most BYTES from the first step on (default: no limit)")
    p.add_argument("--schedule", choices=PIPELINE_NAMES, default="1f1b", help="pipeline: the schedule")
    p.add_argument("--microbatches", type=cli.positive_int, default=4, help="pipeline: micro-batches per step")
    p.add_argument("--chunks", type=cli.positive_int, default=None,
                   help="pipeline: model chunks per rank (interleaved_1f1b; default 1; zbv is always 2)")
    p.add_argument("--dp", type=cli.positive_int, default=1, help="pipeline: data-parallel replicas (2D: dp x pp = ranks)")
    p.add_argument("--epochs", type=cli.positive_int, default=30, help="passes over the training set")
    p.add_argument("--batch-size", type=cli.positive_int, default=64, help="global batch size (all ranks together)")
    p.add_argument("--lr", type=cli.nonneg_float, default=None, help="default: 1e-3 for adam, 0.1 for sgd")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam", help="sgd: with momentum 0.9")
    p.add_argument("--hidden", type=cli.positive_int, default=128, help="width of each hidden layer")
    p.add_argument("--layers", type=cli.positive_int, default=None,
                   help="number of hidden layers (default: 2; pipeline: enough for every stage, max(2, stages))")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0, help="ddp: gradient bucket size in MiB")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="fp16/bf16: mixed precision (fp32 master weights and optimizer state)")
    p.add_argument("--offload", action="store_true",
                   help="optimizer state and master weights on the host (ZeRO-Offload); zero3: the shards too")
    p.add_argument("--recompute", choices=["none", "full"], default="none",
                   help="full: checkpoint_sequential with round(sqrt(layers)) segments")
    p.add_argument("--offload-activations", action="store_true", help="park saved activations in host memory")
    p.add_argument("--seed", type=cli.nonneg_int, default=0, help="seeds the model, the data order and dropout")
    p.add_argument("--json", metavar="PATH", help="write the run's figures as JSON (default: none written)")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome trace (all ranks) of the last steps (default: none)")
    p.add_argument("--plot", metavar="PNG", help="draw the timeline of the last step (default: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    checkpointing.add_arguments(p)
    args = parse_job_args(p, argv)
    checkpointing.check_arguments(p, args)
    refuse_unsupported(p, args, argv, "mlp")
    if args.strategy == "local_sgd" and args.save_every is not None and args.save_every % args.sync_every:
        p.error(f"--save-every {args.save_every} must be a multiple of --sync-every {args.sync_every}: local SGD's "
                f"replicas agree only right after an averaging, and a checkpoint holds one model")
    for name in ("epochs", "batch_size", "hidden", "layers", "sync_every", "microbatches", "chunks", "dp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.lr = {"adam": 1e-3, "sgd": 0.1}[args.optimizer] if args.lr is None else args.lr
    checkpointing.check_resume(p, args)
    return args, p


def evaluate(model, x, y, dtype):
    with minitrain.no_grad():
        logits = model(minitrain.Tensor(x).to(dtype))
    return float((logits.numpy().argmax(axis=1) == y).mean())


def gather_rows(comm, values):
    """Every rank's vector of floats, on every rank (one small all-gather)."""
    mine = np.asarray(values, np.float64)
    return mtcomm.ring_all_gather(comm, mine, total=mine.size * comm.size).reshape(comm.size, -1)


def main(argv=None):
    """Run the job on a memory ledger of its own (as the serving job does; its collectives' progress thread
    takes the ledger of the thread that submits to it): its tables count the bytes this job holds, whatever
    else the process (a notebook, a test session) still holds or frees meanwhile."""
    with memory.use_tracker(memory.MemoryTracker()):
        return _main(argv)


def _main(argv=None):
    args, parser = parse_args(argv)
    comm = init_comm(args)
    world, rank = comm.size, comm.rank
    if args.strategy == "pipeline":
        from minitrain.examples.mlp_pipeline import main_pipeline
        return main_pipeline(args, parser, comm)
    args.layers = 2 if args.layers is None else args.layers
    shares = sorted(set(split_sizes(args.batch_size, world)))     # rows per rank: uneven where world does not divide
    local_batch = "-".join(map(str, shares))

    dtype = np.dtype(PRECISIONS[args.precision])
    mixed = dtype in LOW_PRECISION
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    minitrain.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits(seed=args.seed)
    model = nn.MLP([x_train.shape[1]] + [args.hidden] * args.layers + [10]).to(dtype)
    opt_class, opt_args = ((optim.Adam, dict(lr=1e-3 if args.lr is None else args.lr)) if args.optimizer == "adam"
                           else (optim.SGD, dict(lr=0.1 if args.lr is None else args.lr, momentum=0.9)))
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(args.strategy, 0)

    def optimizer_for(params, comm_for_overflow=None):
        """fp32 master weights in mixed precision; on the host with --offload."""
        agree = found_inf_on_any_rank(comm_for_overflow) if comm_for_overflow is not None else None
        if args.offload:
            return CPUOffloadOptimizer(params, opt_class, all_reduce_found_inf=agree, **opt_args)
        if mixed:
            return optim.MixedPrecisionOptimizer(params, opt_class, all_reduce_found_inf=agree, **opt_args)
        return opt_class(params, **opt_args)
    if args.strategy == "ddp":
        wrapped = DistributedDataParallel(model, comm, bucket_cap_mb=args.bucket_cap_mb)
        opt = optimizer_for(model.parameters())
    elif args.strategy == "local_sgd":            # with fp32 masters, LocalSGD averages the masters
        opt = optimizer_for(model.parameters(), comm)
        wrapped = LocalSGD(model, comm, sync_every=args.sync_every, optimizer=opt)
    elif stage in (1, 2):           # ZeRO-1/2 communicate inside the optimizer: no wrapper
        wrapped = model
        opt = ZeroRedundancyOptimizer(model.parameters(), opt_class, comm, stage=stage,
                                      bucket_cap_mb=args.bucket_cap_mb, offload=args.offload, **opt_args)
    else:
        wrapped = FullyShardedDataParallel(model, comm, offload_params=args.offload)
        opt = optimizer_for(wrapped.parameters(), comm)
    args.dtype = dtype
    if args.device_memory is not None:
        # from here on; building the full model before sharding is not counted (as with PyTorch's
        # meta-device initialisation)
        memory.set_device_capacity(args.device_memory)
    sampler = DistributedSampler(len(x_train), rank, world, seed=args.seed)
    loader = DataLoader((x_train, y_train), args.batch_size, sampler=sampler, global_batch=True)

    ckpt = checkpointing.Checkpointer(
        args, comm, wrapped, opt, layout=layout(args, world, stage),
        extra=lambda: {"loader": loader.state_dict(), "local_sgd": wrapped.state_dict() if args.strategy == "local_sgd" else None},
        optimizer_key=f"optimizer.rank{rank}" if args.strategy == "local_sgd" else "optimizer")
    try:           # local SGD's optimizer states are per replica; it may also start from a common one
        loaded = ckpt.resume(lambda saved: ckpt.optimizer_key if saved.get("strategy") == "local_sgd" else "optimizer")
    except CheckpointError as e:
        return checkpointing.fail(comm, e)
    first_step = 0 if loaded is None else loaded.step
    if loaded is not None:
        loader.load_state_dict(loaded.extra["loader"])
        if args.strategy == "local_sgd" and loaded.extra.get("local_sgd"):
            wrapped.load_state_dict(loaded.extra["local_sgd"])
    memory.reset_peak()
    trace.enable(rank=rank)
    state = {"steps": 0, "seen": 0, "persistent": {}, "host": {}, "events": [], "loss": None, "losses": [],
             "first_step": first_step, "ckpt": ckpt, "timer": StepTimer()}
    offload = offload_activations() if args.offload_activations else None

    def forward(x):
        x = x.to(dtype)                     # mixed precision: compute in fp16/bf16, loss in fp32
        if args.recompute == "full":        # DDP's hooks are on the parameters: it works unchanged
            out = checkpoint_sequential(model, None, x)
        else:
            out = wrapped(x)
        return out.float() if mixed else out    # fp64 stays fp64 (the loss included)
    bar = tqdm(total=args.epochs * len(loader), initial=first_step, disable=args.no_progress or rank != 0,
               file=sys.stdout, desc=f"{args.strategy} x{world}", unit="step")
    comm.barrier()
    start = time.perf_counter()
    try:
        train(args, loader, wrapped, opt, forward, offload, bar, state)
    except memory.DeviceOutOfMemory as e:
        sys.stderr.write(f"[rank {rank}] {args.strategy} does not fit the device: {e}\n")
        sys.stderr.flush()
        if world > 1:
            comm.abort(3)
        return 3
    elapsed = time.perf_counter() - start
    bar.close()
    if args.strategy == "local_sgd" and wrapped.steps % args.sync_every:
        wrapped.synchronize()            # the last checkpoint holds one model: average the replicas first
    ckpt.finish(first_step + state["steps"])
    steps, seen, persistent, step_events, loss = (state[k] for k in ("steps", "seen", "persistent", "events", "loss"))
    if steps == 0:
        return nothing_left(args, comm, first_step)
    _after_training(args, comm, model, wrapped, stage, steps, seen, persistent, step_events, loss, elapsed,
                    x_test, y_test, local_batch, offload, state["host"], state["losses"], first_step, timer=state["timer"])
    return 0


def train(args, loader, wrapped, opt, forward, offload, bar, state):
    steps = seen = 0
    for epoch in range(loader.sampler.epoch, args.epochs):     # resumed: from the checkpoint's epoch
        loader.set_epoch(epoch)
        for xb, yb in loader:
            events_before = len(trace.tracer().events)
            with state["timer"](counted=loader.global_rows == loader.batch_size), trace.span("step", kind="step"):
                with trace.span("forward"):      # this rank's rows' share of the global batch's mean loss
                    if offload is not None:
                        with offload:
                            loss = share_loss(nn.functional.cross_entropy, forward(minitrain.Tensor(xb)), yb,
                                              loader.global_rows, loader.sampler.world)
                    else:
                        loss = share_loss(nn.functional.cross_entropy, forward(minitrain.Tensor(xb)), yb,
                                          loader.global_rows, loader.sampler.world)
                opt.zero_grad()
                with trace.span("backward"):
                    (opt.scale(loss) if hasattr(opt, "scale") else loss).backward()
                with trace.span("optimizer"):
                    opt.step()
                    if args.strategy == "local_sgd":
                        wrapped.step()
            state["persistent"] = persistent_memory()
            state["host"] = memory.host_snapshot()
            steps += 1
            seen += len(xb)
            bar.update(1)
            if steps % 10 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}", epoch=epoch)
            if len(trace.tracer().events) > 50_000:      # keep the last steps only
                del trace.tracer().events[:-5_000]
            state["events"] = trace.tracer().events[events_before:]
            state.update(steps=steps, seen=seen, loss=loss)
            state["losses"].append(loss.data)        # on the device: fetched once, after training
            state["ckpt"].after_step(state["first_step"] + steps)


def layout(args, world, stage):
    """How this run is laid out, for the checkpoint's manifest (and the checks on --resume)."""
    pipeline = args.strategy == "pipeline"
    return {"job": "mlp", "strategy": args.strategy, "world_size": world, "dp": args.dp if pipeline else world,
            "pp": world // args.dp if pipeline else 1, "tp": 1, "zero_stage": stage, "precision": args.precision,
            "optimizer": args.optimizer, "global_batch_size": args.batch_size, "offload": args.offload,
            "sizes": [64] + [args.hidden] * args.layers + [10], "schedule": args.schedule if pipeline else None,
            "chunks": args.chunks if pipeline else None, "sync_every": args.sync_every if args.strategy == "local_sgd" else None}


def global_losses(comm, local):
    """The global loss of every step: each rank's losses (device scalars, fetched in one copy),
    averaged over the ranks (each weighted by its share of the global batch: share_loss)."""
    if not local:
        return []
    mine = backend.to_host(backend.array_module(local[0]).stack(local)).astype(np.float64)
    return [float(v) for v in gather_rows(comm, mine).mean(axis=0)]


def nothing_left(args, comm, first_step):
    """A resumed job whose checkpoint already completed --epochs: nothing to train."""
    if comm.rank == 0:
        print(f"the checkpoint's step {first_step} already completes --epochs {args.epochs}: nothing to train")
        if args.json:
            write_json(args.json, {"world_size": comm.size, "strategy": args.strategy, "steps": 0,
                                   "first_step": first_step, "losses": []})
    return 0


def _after_training(args, comm, model, wrapped, stage, steps, seen, persistent, step_events, loss, elapsed,
                    x_test, y_test, local_batch, offload, host, state_losses=(), first_step=0, *, timer):
    world, rank = comm.size, comm.rank
    # local SGD: the replicas were averaged after the last step (main), so they agree before evaluating
    if stage < 3:                        # under ZeRO-3 each rank holds a different shard, by design
        check_replicas_equal(model, comm)

    events = trace.events()
    waits = sum(e["end"] - e["start"] for e in events if e["name"] in (
        "wait for buckets", "average parameters", "wait for reduce-scatter", "reduce-scatter gradients",
        "all-gather parameters") or e["name"].startswith("all-gather "))
    comm_total = sum(e["end"] - e["start"] for e in events if e["kind"] == "comm" and e["name"].startswith(
        ("ring_", "recursive_doubling")))
    traced_steps = max(1, sum(1 for e in events if e["name"] == "step"))
    step_time = elapsed / steps
    exposed = waits / traced_steps
    psi = model.num_parameters()
    itemsize = args.dtype.itemsize
    sent = comm.stats.bytes_sent
    peak = memory.peak()
    row = [seen / elapsed, step_time - exposed, exposed, comm_total / traced_steps, sent / steps,
           *[persistent[c] for c in ("params", "grads", "optimizer_state")],
           *[peak[c] for c in memory.CATEGORIES], peak["total"],
           *[host[c] for c in ("params", "grads", "optimizer_state")], device_code()]
    table = gather_rows(comm, row)
    step_by_rank, slowest = gather_steps(comm, timer)
    final_loss = float(np.mean(gather_rows(comm, [loss.item()])))
    losses = global_losses(comm, state_losses)
    if args.trace:
        trace.save_chrome(args.trace, comm)
    # every rank evaluates: under ZeRO-3 the forward all-gathers each unit, a collective
    accuracy = evaluate(wrapped if stage == 3 else model, x_test, y_test, args.dtype)
    if rank != 0:
        return 0

    formula = (3 if stage == 3 else 2) * (world - 1) / world * psi * itemsize
    if args.strategy == "local_sgd":
        formula /= args.sync_every
    # optimizer state bytes per parameter: the moments in fp32 (or fp64), plus fp32 master weights
    # in mixed precision (Adam: K = 12, the paper's figure) or the host copy with --offload
    state_item = 4 if args.dtype in LOW_PRECISION else itemsize
    k = {"adam": 2, "sgd": 1}[args.optimizer] * state_item + (state_item if args.dtype in LOW_PRECISION or args.offload else 0)
    state_formula = model_state_bytes(psi, world, stage, param_bytes=itemsize, grad_bytes=itemsize, k=k)
    print(f"\nMLP {model.sizes} ({psi:,} parameters), {args.strategy} on {world} rank(s) "
          f"[{minitrain.backend.describe_device()} on rank 0, transport {transport_name(comm)}], {args.optimizer}, "
          f"{args.epochs} epochs, global batch {args.batch_size} ({local_batch} per rank), {args.precision}")
    print(f"final loss {final_loss:.4f}   test accuracy {accuracy:.2%}   "
          f"{seen * world / elapsed:,.0f} samples/s in all   {elapsed:.1f} s")
    print(f"MPI: {mpi_line()}; check_collectives on, stall threshold {args.comm_timeout:g} s")
    print(f"\n{'rank':>4} {'device':>7} {'samples/s':>10} {'compute/step':>13} {'comm exposed':>13} {'comm total':>11} "
          f"{'sent/step':>10} {'formula':>10} {'peak memory':>12}")
    for r, v in enumerate(table):
        print(f"{r:>4} {device_name(v[17]):>7} {v[0]:>10,.0f} {v[1] * 1e3:>11.2f}ms {v[2] * 1e3:>11.2f}ms "
              f"{v[3] * 1e3:>9.2f}ms {fmt_bytes(v[4]):>10} {fmt_bytes(formula):>10} {fmt_bytes(v[13]):>12}")
    print("\n(comm exposed: time backward waits for the buckets, stragglers included; comm total: time the\n"
          " all-reduces took, overlapping backward when there are several buckets; sent/step averages every\n message, the start-up broadcast"
          " included; formula: " + ("3" if stage == 3 else "2") + "(p-1)/p·Ψ·bytes" + (f" / {args.sync_every}" if args.strategy == "local_sgd" else "")
          + "; peak memory: every category, by rank, in --json)")
    print(planner_line(args, world, slowest, table[:, 13].max()))
    print(f"\nrecompute: {args.recompute}; peak saved activations {fmt_bytes(peak['activations'])}"
          + (f"; offloaded {fmt_bytes(offload.bytes_offloaded / steps)} per step" if offload else ""))
    print("memory on rank 0 (model states at the optimizer step; peak over the run):")
    print(memory_table(persistent, peak))
    if args.offload:
        print(f"  on the host (offloaded): params {fmt_bytes(host['params'])}, grads {fmt_bytes(host['grads'])}, "
              f"optimizer_state {fmt_bytes(host['optimizer_state'])}")
    print(f"  ZeRO formula, stage {stage}: params {fmt_bytes(state_formula['params'])}, grads "
          f"{fmt_bytes(state_formula['grads'])}, optimizer_state {fmt_bytes(state_formula['optimizer_state'])}"
          " (measured: 'at step' above; padding and ZeRO-3's placeholders add a few bytes"
          + ("; --offload puts optimizer_state, and under zero3 params and grads, on the host" if args.offload else "")
          + ")")
    ranks = []
    for r, v in enumerate(table):
        ranks.append({"rank": r, "device": device_name(v[17]), "samples_per_second": v[0], "compute_seconds_per_step": v[1],
                      "comm_exposed_seconds_per_step": v[2], "comm_total_seconds_per_step": v[3],
                      "bytes_sent": v[4] * steps,
                      "memory": {"persistent": dict(zip(("params", "grads", "optimizer_state"), map(int, v[5:8]))),
                                 "peak": dict(zip(list(memory.CATEGORIES) + ["total"], map(int, v[8:14]))),
                                 "host": dict(zip(("params", "grads", "optimizer_state"), map(int, v[14:17])))},
                      "step": step_by_rank[r]})
    if args.json:
        write_json(args.json, {
            "world_size": world, "mpi_library": mpi_line(), "comm_timeout": args.comm_timeout, "strategy": args.strategy,
            "num_params": psi, "final_loss": final_loss, "transport": transport_name(comm),
            "test_accuracy": accuracy, "samples_per_second": seen * world / elapsed, "steps": steps,
            "bytes_per_step": float(np.mean(table[:, 4])), "bytes_per_step_formula": formula,
            "memory_formula": state_formula, "precision": args.precision, "offload": args.offload,
            "recompute": args.recompute, "offload_activations": args.offload_activations,
            "bytes_offloaded_per_step": offload.bytes_offloaded / steps if offload else 0,
            **slowest, "blas_threads": backend.blas_threads(), "ranks": ranks,
            "first_step": first_step, "losses": losses})
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        trace.plot_timeline([e for e in step_events if e["kind"] != "step"],
                            title=f"rank 0, last step: compute and each bucket's all-reduce ({args.strategy})")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The main job: an MLP trained on the real 8x8 digits, data-parallel over every rank.

    mpirun -n 4 python -m minitrain.examples.mlp [--strategy ddp|local_sgd|zero1|zero2|zero3]
        [--precision fp32|fp64|fp16|bf16] [--offload] [--device-memory BYTES] [--batch-size 64]
        [--json out.json] [--show-plan] [--trace trace.json] [--plot step.png] [--save-dir DIR --save-every N --resume]

Each rank trains on its DistributedSampler share of every global batch (--batch-size is global; shares
differ by a row where the ranks do not divide it, and an epoch's last batch is partial: nothing padded or
dropped), its mean loss weighted by its rows over the global batch's (share_loss), and DDP averages the
gradients, so N ranks take exactly the steps one process would take on the whole batch. Rank 0 shows the
progress bar and, at the end, the accuracy, a table per rank (the steady-state step: compute + exposed
communication; bytes sent beside the ring formula; examples/mlp_report.py) and memory; --show-plan, the
planner's prediction beside it. --save-dir/--save-every/--resume: sharded checkpoints, resumable on any
layout (examples/checkpointing.py); the JSON's losses are the global loss of every step run.
"""
import contextlib
import sys
import time

import numpy as np

import minitrain
from minitrain import cli, memory, nn, optim
from minitrain.backend import LOW_PRECISION
from minitrain.checkpoint import CheckpointError
from minitrain.data import DataLoader, DistributedSampler, load_digits, share_loss
from minitrain.examples import checkpointing
from minitrain.examples.common import PRECISIONS, init_comm, job_parser, parse_job_args, tqdm
from minitrain.examples.mlp_common import (check_values, does_not_fit, layout, loss_scaler, nothing_left,
                                           replica_reduction, resume, split_seed)
from minitrain.examples.mlp_report import Run, report
from minitrain.examples.report import StepWatch, traced
from minitrain.examples.options import refuse_unsupported
from minitrain.parallel import (CPUOffloadOptimizer, DistributedDataParallel, FullyShardedDataParallel, LocalSGD,
                                ZeroRedundancyOptimizer, checkpoint_sequential, found_inf_on_any_rank,
                                offload_activations)
from minitrain.parallel.pipeline import NAMES as PIPELINE_NAMES

STRATEGIES = ("ddp", "local_sgd", "zero1", "zero2", "zero3", "pipeline")


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
    p.add_argument("--seed", type=cli.nonneg_int, default=0, help="seeds the model, data order, dropout and test split")
    p.add_argument("--json", type=cli.output_file, metavar="PATH",
                   help="write the run's figures as JSON (default: none written)")
    p.add_argument("--show-plan", action="store_true", help="also print the planner's prediction beside the measured "
                   "step (busy CPU and wall clock, in anchor units) and memory; always in --json")
    p.add_argument("--trace", type=cli.output_file, metavar="PATH",
                   help="write a Chrome trace (all ranks) of the last steps (default: none)")
    p.add_argument("--plot", type=cli.output_image, metavar="PNG",
                   help="draw the timeline of the last step (default: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    checkpointing.add_arguments(p)
    args = parse_job_args(p, argv)
    checkpointing.check_arguments(p, args)
    refuse_unsupported(p, args, argv, "mlp")
    check_values(p, args)
    args.lr = {"adam": 1e-3, "sgd": 0.1}[args.optimizer] if args.lr is None else args.lr
    args.split_seed = split_seed(p, args, checkpointing.check_resume(p, args, "mlp"))
    return args, p


def main(argv=None):
    """Run the job on a memory ledger of its own (its collectives' progress thread takes it too): its tables
    count the bytes this job holds, whatever else the process (a notebook, a test session) holds meanwhile."""
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
    dtype = np.dtype(PRECISIONS[args.precision])
    mixed = dtype in LOW_PRECISION
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    minitrain.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits(seed=args.split_seed)
    model = nn.MLP([x_train.shape[1]] + [args.hidden] * args.layers + [10]).to(dtype)
    opt_class, opt_args = ((optim.Adam, dict(lr=1e-3 if args.lr is None else args.lr)) if args.optimizer == "adam"
                           else (optim.SGD, dict(lr=0.1 if args.lr is None else args.lr, momentum=0.9)))
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(args.strategy, 0)
    reduce_op, args.backward_seed = replica_reduction(args, mixed, world)     # 16-bit: divided before the sum

    def optimizer_for(params, comm_for_overflow=None):
        """fp32 master weights in mixed precision; on the host with --offload."""
        agree = found_inf_on_any_rank(comm_for_overflow) if comm_for_overflow is not None else None
        if args.offload:
            return CPUOffloadOptimizer(params, opt_class, all_reduce_found_inf=agree, **opt_args)
        if mixed:
            return optim.MixedPrecisionOptimizer(params, opt_class, all_reduce_found_inf=agree, **opt_args)
        return opt_class(params, **opt_args)
    if args.strategy == "ddp":
        wrapped = DistributedDataParallel(model, comm, bucket_cap_mb=args.bucket_cap_mb, reduce_op=reduce_op)
        opt = optimizer_for(model.parameters())
    elif args.strategy == "local_sgd":            # with fp32 masters, LocalSGD averages the masters
        opt = optimizer_for(model.parameters(), comm)
        wrapped = LocalSGD(model, comm, sync_every=args.sync_every, optimizer=opt)
    elif stage in (1, 2):           # ZeRO-1/2 communicate inside the optimizer: no wrapper
        wrapped = model
        opt = ZeroRedundancyOptimizer(model.parameters(), opt_class, comm, stage=stage, reduce_op=reduce_op,
                                      bucket_cap_mb=args.bucket_cap_mb, offload=args.offload, **opt_args)
    else:
        wrapped = FullyShardedDataParallel(model, comm, offload_params=args.offload, reduce_op=reduce_op)
        opt = optimizer_for(wrapped.parameters(), comm)
    args.dtype = dtype
    if args.device_memory is not None:      # from here on: building the full model before sharding is not
        try:                                                 # counted (PyTorch's meta-device initialisation)
            memory.set_device_capacity(args.device_memory)
        except memory.DeviceOutOfMemory as e:
            return does_not_fit(args, comm, e)
    sampler = DistributedSampler(len(x_train), num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader((x_train, y_train), args.batch_size, sampler=sampler, global_batch=True)

    try:
        ckpt, first_step = resume(args, comm, wrapped, opt, loader, layout(args, world, stage))
    except CheckpointError as e:
        return checkpointing.fail(comm, e)
    memory.reset_peak()

    if args.recompute == "full":            # the model's own forward: every wrapper runs it in its call (FSDP
        model.forward = lambda x: checkpoint_sequential(model, None, x)   # under its hooks that free the units)

    def forward(x):
        out = wrapped(x.to(dtype))          # mixed precision: compute in fp16/bf16, loss in fp32
        return out.float() if mixed else out    # fp64 stays fp64 (the loss included)
    forward, opt.step = traced(forward, "forward"), traced(opt.step, "optimizer")   # the timeline's phases
    offload = offload_activations() if args.offload_activations else None
    watch, run = StepWatch(rank), Run(first_step=first_step, scaler=loss_scaler(opt) if mixed else None)
    bar = tqdm(total=args.epochs * len(loader), initial=first_step, disable=args.no_progress or rank != 0,
               file=sys.stdout, desc=f"{args.strategy} x{world}", unit="step")
    comm.barrier()
    start = time.perf_counter()
    try:
        train(args, loader, wrapped, opt, forward, offload or contextlib.nullcontext(), bar, watch, run, ckpt)
    except memory.DeviceOutOfMemory as e:
        return does_not_fit(args, comm, e)
    run.elapsed = time.perf_counter() - start
    bar.close()
    if args.strategy == "local_sgd" and wrapped.steps % args.sync_every:
        wrapped.synchronize()            # the last checkpoint holds one model: average the replicas first
    ckpt.finish(first_step + run.steps)
    if run.steps == 0:
        return nothing_left(args, comm, first_step)
    return report(args, comm, model, wrapped, stage, watch, run, (x_test, y_test), offload)


def train(args, loader, wrapped, opt, forward, offload, bar, watch, run, ckpt):
    """The training loop. watch.step times and traces each step and reads the memory ledger after it."""
    for epoch in range(loader.sampler.epoch, args.epochs):     # resumed: from the checkpoint's epoch
        loader.set_epoch(epoch)
        for xb, yb in loader:
            with watch.step(counted=loader.global_rows == loader.batch_size):
                with offload:       # this rank's rows' share of the global batch's mean loss
                    loss = share_loss(nn.functional.cross_entropy, forward(minitrain.Tensor(xb)), yb,
                                      loader.global_rows, loader.sampler.world)
                opt.zero_grad()
                (opt.scale(loss) if hasattr(opt, "scale") else loss).backward(args.backward_seed)
                opt.step()
                if args.strategy == "local_sgd":
                    wrapped.step()
            run.steps += 1
            run.losses.append(loss.data)        # on the device: fetched once, after training
            bar.update(1)
            if run.steps % 10 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}", epoch=epoch)
            ckpt.after_step(run.first_step + run.steps)


if __name__ == "__main__":
    sys.exit(main())

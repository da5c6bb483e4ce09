"""What the MLP job's two halves share (mlp.py: every data-parallel strategy; mlp_pipeline.py: the
pipelines): the values checked across options, how a run is laid out (the checkpoint's manifest), how
16-bit gradients are reduced, the global loss of every step, the test accuracy, the answer of a resumed run
with nothing left to train, and a device too small for the run.
"""
import sys

import numpy as np

import minitrain
from minitrain import backend
from minitrain import comm as mtcomm
from minitrain.data.digits import train_rows
from minitrain.checkpoint import CheckpointError
from minitrain.examples import checkpointing
from minitrain.examples.report import write_json


def check_values(parser, args):
    """What one option's type cannot check: a batch above the training split (it would be the whole split
    each step, not the size asked for); local SGD's checkpoints only where its replicas agree."""
    if args.batch_size > train_rows():
        parser.error(f"argument --batch-size: must be at most {train_rows()} (the digits' training split has "
                     f"{train_rows()} samples), got {args.batch_size}")
    if args.strategy == "local_sgd" and args.save_every is not None and args.save_every % args.sync_every:
        parser.error(f"--save-every {args.save_every} must be a multiple of --sync-every {args.sync_every}: local "
                     f"SGD's replicas agree only right after an averaging, and a checkpoint holds one model")


def split_seed(parser, args, saved_layout):
    """The seed that splits the digits into training and test rows: --seed, but on --resume the checkpoint's, whatever
    seed --override-opt-param-scheduler gives the data order from there on (another split would train on test rows).
    The values are checked again first: --use-checkpoint-opt-param-scheduler may have taken the checkpoint's
    --sync-every, which --save-every must be a multiple of."""
    check_values(parser, args)
    return saved_layout.get("split_seed", args.seed)


def layout(args, world, stage):
    """How this run is laid out, for the checkpoint's manifest (and the checks on --resume)."""
    pipeline = args.strategy == "pipeline"
    return {"job": "mlp", "strategy": args.strategy, "world_size": world, "dp": args.dp if pipeline else world,
            "pp": world // args.dp if pipeline else 1, "tp": 1, "zero_stage": stage, "precision": args.precision,
            "optimizer": args.optimizer, "global_batch_size": args.batch_size, "offload": args.offload,
            "sizes": [64] + [args.hidden] * args.layers + [10], "schedule": args.schedule if pipeline else None,
            "chunks": args.chunks if pipeline else None,
            "sync_every": args.sync_every if args.strategy == "local_sgd" else None, "split_seed": args.split_seed}


def evaluate(model, x, y, dtype):
    with minitrain.no_grad():
        logits = model(minitrain.Tensor(x).to(dtype))
    return float((logits.numpy().argmax(axis=1) == y).mean())


def gather_rows(comm, values):
    """Every rank's vector of floats, on every rank (one small all-gather)."""
    mine = np.asarray(values, np.float64)
    return mtcomm.ring_all_gather(comm, mine, total=mine.size * comm.size).reshape(comm.size, -1)


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


def resume(args, comm, wrapped, opt, loader, layout):
    """The data-parallel job's Checkpointer, and the step it starts from (0, or the checkpoint's with --resume:
    the loader's position and LocalSGD's counters restored). Raises CheckpointError, also where local SGD's last
    checkpoint, its replicas averaged off the period as a run ends, would be continued: no exact continuation."""
    local_sgd = args.strategy == "local_sgd"

    def restore(saved):
        loader.load_state_dict(saved["loader"])
        if local_sgd and saved.get("local_sgd"):
            wrapped.load_state_dict(saved["local_sgd"])
    ckpt = checkpointing.Checkpointer(
        args, comm, wrapped, opt, layout=layout, restore=restore,
        extra=lambda: {"loader": loader.state_dict(), "local_sgd": wrapped.state_dict() if local_sgd else None},
        optimizer_key=f"optimizer.rank{comm.rank}" if local_sgd else "optimizer")
    # local SGD's optimizer states are per replica; it may also start from a common one
    first = ckpt.start_step(lambda saved: ckpt.optimizer_key if saved.get("strategy") == "local_sgd" else "optimizer")
    averaged = (ckpt.loaded.extra.get("local_sgd") or {}) if ckpt.loaded is not None else {}
    if averaged and ckpt.loaded.layout.get("world_size", 1) > 1 and averaged["steps"] % averaged["sync_every"] \
            and first < args.epochs * len(loader):
        raise CheckpointError(
            f"{ckpt.loaded.path} holds local SGD's replicas averaged at step {first}, the last step of the run that "
            f"saved it, off its --sync-every {averaged['sync_every']} period: the uninterrupted run goes on from "
            f"replicas not averaged there, so this one cannot continue it; resume from a checkpoint at a multiple of "
            f"{averaged['sync_every']} steps (--save-every {averaged['sync_every']})")
    return ckpt, first


def replica_reduction(args, mixed, world):
    """(reduce_op, backward's seed). 16-bit gradients: each replica's backward seeded with 1/world, then summed
    (PyTorch DDP's order: no partial sum exceeds the global gradient, so fp16's range is one process's); the
    seed a device scalar made once. Local SGD averages weights instead."""
    if not mixed or args.strategy == "local_sgd" or world == 1:
        return "mean", None
    return "sum", backend.to_device(np.asarray(1.0 / world, np.float32))


def loss_scaler(opt):
    """The optimizer that keeps mixed precision's loss scale (ZeRO-1/2: the one inside)."""
    return opt if hasattr(opt, "skipped_steps") else opt.optimizer


def does_not_fit(args, comm, error):
    """--device-memory too small (memory.DeviceOutOfMemory): this rank says why and, as the others would wait
    for it, the job aborts; the exit status is 3."""
    sys.stderr.write(f"[rank {comm.rank}] {args.strategy} does not fit the device: {error}\n")
    sys.stderr.flush()
    if comm.size > 1:
        comm.abort(3)
    return 3

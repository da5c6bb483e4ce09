"""What the GPT job's two halves share (gpt.py: one process; gpt_parallel.py: a dp x pp x tp mesh): the
validation loss, the learning-rate schedule (linear warm-up, cosine decay: LambdaLR(warmup_cosine)), how a
run is laid out (the checkpoint's manifest), and the answer of a resumed run with nothing left to train.
"""
import numpy as np

import minitrain
from minitrain.examples.report import write_json
from minitrain.optim.lr_scheduler import LambdaLR, warmup_cosine


def estimate_loss(model, corpus, args, rng, batches=4):
    model.eval()
    losses = []
    with minitrain.no_grad():
        for _ in range(batches):
            x, y = corpus.get_batch("val", args.batch_size, args.block_size, rng)
            losses.append(model(x, y)[1].item())
    model.train()
    return float(np.mean(losses))


def scheduler_for(opt, args):
    """The GPT's schedule: linear warm-up then cosine to lr/10 (PyTorch: the same LambdaLR)."""
    factor = warmup_cosine(args.warmup_steps, args.steps) if args.lr_schedule == "cosine" else (lambda step: 1.0)
    return LambdaLR(opt, factor)


def layout(args, strategy="single", dp=1, pp=1, tp=1, world=1):
    """How this run is laid out, for the checkpoint's manifest (and the checks on --resume)."""
    return {"job": "gpt", "strategy": strategy, "world_size": world, "dp": dp, "pp": pp, "tp": tp, "zero_stage": 0,
            "sequence_parallel": args.sequence_parallel, "schedule": args.schedule if pp > 1 else None,
            "microbatches": args.microbatches, "chunks": args.chunks, "precision": args.precision,
            "optimizer": "adamw", "global_batch_size": args.batch_size, "block_size": args.block_size,
            "model": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                      "block_size": args.block_size, "dropout": args.dropout}}


def nothing_left(args, first_step, rank=0, world=1):
    """A resumed job whose checkpoint already completed --steps: nothing to train."""
    if rank == 0:
        print(f"the checkpoint's step {first_step} already completes --steps {args.steps}: nothing to train")
        if args.json:
            write_json(args.json, {"world_size": world, "steps": 0, "first_step": first_step, "losses": []})
    return 0

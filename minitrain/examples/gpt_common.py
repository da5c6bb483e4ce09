"""What the GPT job's two halves share (gpt.py: one process; gpt_parallel.py: a dp x pp x tp mesh): the
validation loss, the learning-rate schedule (linear warm-up, cosine decay: LambdaLR(warmup_cosine)), how a
run is laid out (the checkpoint's manifest), and the answer of a resumed run with nothing left to train.
"""
import dataclasses
import math

import numpy as np

import minitrain
from minitrain import backend, nn, optim
from minitrain.comm import all_reduce
from minitrain.examples.report import fmt_bytes, write_json
from minitrain.optim.lr_scheduler import LambdaLR, warmup_cosine
from minitrain.plan.layout import MIXED


def estimate_loss(model, corpus, args, rng, batches=4):
    """The mean loss in eval mode over ``batches`` validation batches drawn from ``rng``: the GPT's forward, or a
    GPT3D's eval_step (Megatron's evaluate: every rank, none holding the whole model)."""
    draws = [corpus.get_batch("val", args.batch_size, args.block_size, rng) for _ in range(batches)]
    if hasattr(model, "eval_step"):                 # GPT3D: in eval mode through its mesh
        return float(np.mean([model.eval_step(x, y) for x, y in draws]))
    model.eval()
    with minitrain.no_grad():
        losses = [model(x, y)[1].item() for x, y in draws]
    model.train()
    return float(np.mean(losses))


def scheduler_for(opt, args):
    """The GPT's schedule: linear warm-up then cosine to lr/10, or (constant) to lr itself: a cosine from 1 to 1
    (PyTorch: the same LambdaLR)."""
    factor = warmup_cosine(args.warmup_steps, args.steps, min_ratio=0.1 if args.lr_schedule == "cosine" else 1.0)
    return LambdaLR(opt, factor)


def layout(args, strategy="single", dp=1, pp=1, tp=1, world=1):
    """How this run is laid out, for the checkpoint's manifest (and the checks on --resume)."""
    return {"job": "gpt", "strategy": strategy, "world_size": world, "dp": dp, "pp": pp, "tp": tp, "cp": args.cp,
            "ep": args.ep, "zero_stage": args.zero,
            "sequence_parallel": args.sequence_parallel, "schedule": args.schedule if pp > 1 else None,
            "microbatches": args.microbatches, "chunks": args.chunks, "precision": args.precision,
            "optimizer": "adamw", "global_batch_size": args.batch_size, "block_size": args.block_size,
            "model": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                      "block_size": args.block_size, "dropout": args.dropout,
                      "moe_experts": args.moe_experts,   # the rest only with experts (then they shape the model)
                      **{key: value for key, value in moe_options(args, dp).items() if args.moe_experts}}}


def moe_options(args, dp=1):
    """GPTConfig's MoE fields for the whole global batch (groups: --moe-groups, default one per replica and
    micro-batch: each routes its own rows)."""
    return {"moe_experts": args.moe_experts, "moe_top_k": args.moe_top_k, "moe_capacity_factor": args.moe_capacity_factor,
            "moe_every": args.moe_every, "moe_aux_loss_coef": args.moe_aux_loss_coef,
            "moe_groups": args.moe_groups or dp * args.microbatches}


def gpt_config(args, vocab_size, dp=1, replica=False):
    """The job's GPTConfig; ``replica``: the one a data-parallel replica runs on its rows of the global batch,
    which hold groups / dp of the global batch's capacity groups."""
    moe = moe_options(args, dp)
    if replica:
        moe["moe_groups"] //= dp
    return nn.GPTConfig(vocab_size=vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                        n_embd=args.n_embd, dropout=args.dropout,
                        recompute=None if args.recompute == "none" else args.recompute, **moe)


def adamw(params, args, init_scale=2.0 ** 16, all_reduce_found_inf=None):
    """The GPT jobs' AdamW (weight decay 0.01); with --precision fp16 / bf16 inside a MixedPrecisionOptimizer:
    fp32 masters and moments, fp16's dynamic loss scale from ``init_scale``, ``all_reduce_found_inf`` where the
    ranks hold different parameters (optim/mixed_precision.py)."""
    if args.precision not in MIXED:
        return optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    return optim.MixedPrecisionOptimizer(params, optim.AdamW, init_scale=init_scale, lr=args.lr, weight_decay=0.01,
                                         all_reduce_found_inf=all_reduce_found_inf)


def backward_and_clip(opt, loss, params, max_norm=1.0):
    """Backward of ``loss`` and clipping to ``max_norm``; returns the norm before clipping. Mixed precision: the
    backward of the loss times the scale, clipped by the true gradient's norm (the scale divided out)."""
    if isinstance(opt, optim.MixedPrecisionOptimizer):
        opt.scale(loss).backward()
        return opt.clip_grad_norm_(max_norm)
    loss.backward()
    return optim.clip_grad_norm_(params, max_norm)


def mixed_precision(opt):
    """The JSON's mixed-precision figures from the MixedPrecisionOptimizer ``opt``: the steps skipped for inf/NaN
    gradients (fp16's loss scale too large; every rank skips the same ones) and the loss scale at the end;
    none for another optimizer (fp32 / fp64)."""
    if not hasattr(opt, "skipped_steps"):
        return {}
    return {"skipped_steps": opt.skipped_steps, "loss_scale": opt.loss_scale}


def grad_norms(norms):
    """The JSON's "grad_norms": each step's gradient norm before clipping, as Megatron logs it (mixed precision:
    the true gradient's, the loss scale divided out), read once after training (on the GPU each is a 0-d device
    array); None where it was inf or NaN (a step fp16's loss scale overflowed, skipped)."""
    values = [float(backend.to_scalar(n)) if backend.is_device_array(n) else float(n) for n in norms]
    return [v if math.isfinite(v) else None for v in values]


def moe_layers(model):
    return [block.mlp for i, block in enumerate(model.h) if model.config.is_moe_layer(i)]


def moe_step(model, comm=None):
    """The last training forward's figures over the global batch: (load_max_over_mean, the largest over the MoE
    layers, of each layer's load summed over replicas; tokens dropped, summed over layers and replicas; the
    balancing loss, summed over layers and averaged over replicas as the loss is)."""
    stats = [layer.statistics() for layer in moe_layers(model)]
    dp = 1 if comm is None else comm.size
    row = np.array([x for s in stats for x in s["load"]] + [sum(s["tokens_dropped"] for s in stats),
                                                             sum(s["aux_loss"] for s in stats) / dp], np.float64)
    if comm is not None:
        row = all_reduce(comm, row, op="sum")
    loads = row[:-2].reshape(len(stats), -1)
    return float((loads.max(axis=1) / loads.mean(axis=1)).max()), int(round(row[-2])), float(row[-1])


def moe_summary(steps):
    """The JSON "moe" block from the steps' moe_step figures, and the table's line."""
    block = {"load_max_over_mean": [s[0] for s in steps], "tokens_dropped": sum(s[1] for s in steps),
             "aux_loss": [s[2] for s in steps]}
    line = (f"moe: load max/mean {np.mean(block['load_max_over_mean']):.3f} (mean over steps, largest over layers), "
            f"tokens dropped {block['tokens_dropped']}, balancing loss {block['aux_loss'][0]:.5f} -> "
            f"{block['aux_loss'][-1]:.5f}")
    return block, line


def all_to_all_sent(ep_comm):
    """This rank's all_to_all_single bytes so far on the expert-parallel communicator (0 without one)."""
    return ep_comm.stats["all_to_all_single"]["bytes_sent"] if ep_comm is not None else 0


def all_to_all_step(ep_comm, ep_layers, before):
    """One step's (measured, formula) all-to-all bytes: sent since ``before``, and what the layers' split
    sizes say they sent (their counts restart for the next step)."""
    formula = sum(layer.all_to_all_bytes_formula for layer in ep_layers)
    for layer in ep_layers:
        layer.all_to_all_bytes_formula = 0
    return all_to_all_sent(ep_comm) - before, formula


def routing_step(moe_layers):
    """One step's rows per MoE layer of this rank: [(rows its experts took, its routed choices N·k)] (their
    counts restart for the next step)."""
    rows = [(layer.rows_taken, layer.rows_routed) for layer in moe_layers]
    for layer in moe_layers:
        layer.rows_taken = layer.rows_routed = 0
    return rows


def routing_load(comm, routing, ep, per_layer=False):
    """(peak, step): the busiest rank's experts' rows over its own routed rows in the run's most loaded step
    (what its memory must hold: the planner's --moe-load) and in its median step (what the median step's
    time meets): above 1 where ep brings it more than an even share, below where a capacity drops rows. A
    step's load is its layers' rows together, as every layer's activations are held at once; the peak's, with
    ``per_layer`` (full recomputation: one block's activations at a time), its busiest layer's. The peak
    leaves the first step out where there are others: the optimizer's state is made at its end, so the run's
    memory peaks in a later step (the planner's moment), whose routing has moved. 1 with no MoE layer (a
    collective: every rank calls it, a stage without MoE layers with empty steps)."""
    if not routing:
        return 1.0, 1.0
    busiest = _busiest_per_step(comm, _step_loads(routing), ep)
    if not busiest.any():                                               # no MoE layer routed a row
        return 1.0, 1.0
    return _peak(busiest, per_layer), float(np.median(busiest[0]))


def stage_routing_loads(comm, routing, ep, stage, stages, per_layer=False):
    """routing_load's peak for each of the ``stages`` pipeline stages, over that stage's ranks alone (this rank
    holds ``stage``): a stage's memory holds its own MoE layers' rows, so it is planned at its own load, not at
    one that another stage's layers routed (1 for a stage without MoE layers; a collective)."""
    mine = np.zeros((stages, 2, len(routing)))
    mine[stage] = _step_loads(routing)
    busiest = _busiest_per_step(comm, mine, ep)
    return [_peak(b, per_layer) if b.any() else 1.0 for b in busiest]


def _step_loads(routing):
    """[[each step's layers together], [each step's busiest layer]]: this rank's experts' rows over its routed."""
    ratio = lambda taken, routed: taken / routed if routed else 0.0        # noqa: E731
    together = [ratio(sum(t for t, _ in step), sum(r for _, r in step)) for step in routing]
    busiest_layer = [max((ratio(t, r) for t, r in step), default=0.0) for step in routing]
    return np.array([together, busiest_layer])


def _busiest_per_step(comm, mine, ep):
    """The largest over the ranks of each step's loads, at most ep (a collective unless ``comm`` is None)."""
    return np.minimum(mine if comm is None else all_reduce(comm, mine, op="max"), ep)


def _peak(busiest, per_layer):
    """The most loaded step's load, the first step left out where there are others (routing_load's peak)."""
    whole = busiest[:, 1:] if busiest.shape[1] > 1 else busiest          # the steps with every model state
    return float(whole[1 if per_layer else 0].max())


def all_to_all_summary(comm, a2a, ep):
    """From each rank's (measured, formula) all-to-all bytes per step: the busiest rank's mean over steps of
    each, the (rank, step, measured | formula) table, and the report's line (a collective on ``comm``)."""
    table = all_reduce(comm, np.eye(comm.size)[comm.rank][:, None, None] * np.array(a2a, np.float64)[None],
                       op="sum").astype(np.int64)
    measured, formula = (float(table[:, :, i].mean(axis=1).max()) for i in (0, 1))
    line = (f"all-to-all (ep {ep}): {measured:,.1f} B ({fmt_bytes(measured)}) sent per step by the busiest rank (mean "
            f"over steps; dispatch and combine, forward and backward), formula from the split sizes {formula:,.1f} B")
    return measured, formula, table, line


def print_sample(model, config, corpus, args):
    """The trained model's continuation of "def ": --sample-chars characters (none asked, nothing sampled)."""
    if args.sample_chars:
        sample = _sample_model(model, config).generate(corpus.encode("def ")[None, :], args.sample_chars,
                                                       temperature=0.8, top_k=20, rng=np.random.default_rng(args.seed))
        print("sample:\n" + corpus.decode(sample[0]))


def _sample_model(model, config):
    """A model to sample from: capacity groups need whole groups of tokens, a cached decode step has one, so
    a model with groups > 1 samples from its copy counting capacity over the step's tokens."""
    if not config.moe_experts or config.moe_groups == 1:
        return model
    with minitrain.random.use_generator(minitrain.random.fork()):
        copy = nn.GPT(dataclasses.replace(config, moe_groups=1))
    copy.load_state_dict(model.state_dict())
    copy.eval()
    return copy


def nothing_left(args, first_step, rank=0, world=1):
    """A resumed job whose checkpoint already completed --steps: nothing to train."""
    if rank == 0:
        print(f"the checkpoint's step {first_step} already completes --steps {args.steps}: nothing to train")
        if args.json:
            write_json(args.json, {"world_size": world, "steps": 0, "first_step": first_step, "losses": []})
    return 0

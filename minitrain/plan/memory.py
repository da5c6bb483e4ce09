"""Bytes per rank by category (params, grads, optimizer_state, activations, comm_buffers), two accountings.

paper: the papers' assumptions, to reproduce their tables (plan/papers.py: ZeRO's model states, Rajbhandari
et al. 2020, Figure 1; Korthikanti et al. 2022, Table 2's activations per transformer layer).

minitrain: the bytes minitrain.memory's ledger counts, its peak per category: plan/walks.py's step_walk
replays one step as the ledger sees it, pipeline_walk a stage along its schedule (its layers cut and placed
as the runtime does: plan/stages.py); what each layer keeps for backward is plan/activations.py's, the
model states plan/states.py's.
"""
from dataclasses import replace
from functools import lru_cache
from types import MappingProxyType

from ..parallel.pipeline.schedules import SPLIT_BACKWARD, microbatch_sizes
from .activations import gpt_pieces, mlp_pieces
from .experts import expert_params_per_rank, expert_step_grads, routed_expert_params, zero_expert_extra
from .layout import PRECISIONS, Layout
from .papers import paper_memory
from .stages import _schedule, in_flight, stage_chunks
from .states import CATEGORIES, _one_moment, model_states_at_rest
from .walks import pipeline_walk, step_walk


@lru_cache(maxsize=4096)
def _count(pieces):
    """(parameters, parameter tensors) of some pieces."""
    return sum(p.params for p in pieces), sum(len(p.sizes) for p in pieces)


def _stage_result(peak, total, at_peak):
    """Each category at the peak moment (they sum to the total), and each category's own peak beside."""
    parts = {c: int(round(at_peak[c])) for c in CATEGORIES}
    return {**parts, "total": sum(parts.values()), "category_peaks": {c: int(round(peak[c])) for c in CATEGORIES}}


def minitrain_memory(model, layout):
    """Per stage: peak bytes per category and total, as the jobs' ledgers count them."""
    b = layout.micro_batch_size
    if model.kind == "params":
        return [_one_moment(model_states_at_rest(model.num_params, layout))]
    if model.kind == "mlp" and layout.pp == 1:
        peak, total, at_peak = step_walk(mlp_pieces(model, layout, b), layout, layout.dp)
        return [_stage_result(peak, total, at_peak)]
    single = model.kind == "gpt" and layout.world == 1 and not layout.extras.get("parallel_job")
    if single or layout.extras.get("moe_dp_job"):       # nn.GPT itself (with MoE on dp ranks: under DDP)
        lay = layout if layout.zero or layout.world > 1 else _no_buffers(layout)
        if layout.ep > 1:
            lay = replace(lay, extras={**lay.extras, "ddp_excluded_params": expert_params_per_rank(model, layout)})
        peak, total, at_peak = step_walk(gpt_pieces(model, layout, b, single_process=True), lay, layout.dp)
        return [_stage_result(peak, total, at_peak)]
    pieces = tuple(mlp_pieces(model, layout, b, in_pipeline=True) if model.kind == "mlp"
                   else gpt_pieces(model, layout, b))
    sizes = microbatch_rows(layout)
    # else the schedule's in-flight counts say it all (not for zero-bubble schedules: B and W free apart)
    every_action = layout.chunks > 1 or sizes is not None or layout.schedule in SPLIT_BACKWARD
    stages = []
    for s, (alike, actions, chunks, own, local, others) in enumerate(
            pipeline_stages(pieces, layout.schedule, layout.pp, layout.microbatches, layout.chunks, every_action)):
        if alike < s:           # its own copy: a caller may change one stage's
            stages.append({**stages[alike], "category_peaks": dict(stages[alike]["category_peaks"])})
            continue
        walked = pipeline_walk(actions, chunks, layout, local, others, sizes, expert_step_grads(model, layout, own))
        stages.append(_experts_sharded(_stage_result(*walked), model, layout, own))
    return stages


@lru_cache(maxsize=1024)
def pipeline_stages(pieces, schedule, pp, microbatches, chunks, every_action):
    """Per stage of ``pieces`` cut along this pipeline: (the first stage alike it, its actions or in-flight
    counts, chunk -> its pieces, its pieces together, their parameters, the other stages' parameter tensors).
    Cached: the search's layouts that differ only in what the walk alone reads (the ZeRO stage, the optimizer)
    share it, and its arguments are all it reads (Pieces compare by identity: the same pieces, the same objects)."""
    tensors = sum(len(x.sizes) for x in pieces)
    out, first = [], {}
    cut = stage_chunks(pieces, Layout(pp=pp, chunks=chunks, schedule=schedule))    # it reads these three
    for s, stage in enumerate(cut):
        actions = (_schedule(schedule, pp, microbatches, chunks)[s] if every_action
                   else in_flight(schedule, pp, microbatches, s))
        mine = tuple(tuple(ps) for ps in stage.values())
        # stages alike: the same layers, as many in flight (every action: each stage its own)
        alike = first.setdefault(s if every_action else (actions, mine), s)
        own = tuple(x for ps in mine for x in ps)       # the stage's pieces, its chunks together
        local, count = _count(own)
        out.append((alike, actions, MappingProxyType(stage), own, local, tensors - count if pp > 1 else 0))
    return tuple(out)


def microbatch_rows(layout):
    """The heaviest replica's micro-batches' rows, as the jobs cut them: the replica's ceil(batch / dp) rows,
    the first rows % m micro-batches one more (None where they are equal)."""
    rows, m = layout.replica_rows, layout.microbatches
    return None if rows % m == 0 else tuple(microbatch_sizes(rows, m))


def _experts_sharded(stage, model, layout, pieces):
    """A stage's bytes with its routed experts' states sharded by ZeRO over dp/ep, not dp (plan/experts.py)."""
    if model.kind != "gpt" or not model.moe_experts or not layout.zero or layout.ep == 1:
        return stage
    for c, n in zero_expert_extra(model, layout, pieces).items():
        stage[c] += n
        stage["category_peaks"][c] += n
        stage["total"] += n
    if layout.zero >= 2:
        _expert_gradient_shards(stage, model, layout, pieces)
    return stage


def _expert_gradient_shards(stage, model, layout, pieces):
    """ZeRO-2/3 under ep (parallel/expert_parallel_3d.py's ExpertZero): the dense gradient is reduce-scattered
    over dp (x cp) and its full buffer dropped, then the experts' over dp/ep (x cp) into a wider shard. The
    gradients' peak is the larger of those two moments, not the stage's whole flat gradient beside its dp
    shard (the walk's); the step's peak gains the experts' wider shard where it is the optimizer step, or is
    that moment itself."""
    e, dp, ep = PRECISIONS[layout.precision], layout.zero_ranks, layout.ep
    local = sum(x.params for x in pieces)
    n = routed_expert_params(model, layout, pieces)
    dense_shard, wide, pad = -(-(local - n) // dp), -(-n // (dp // ep)), -(-local // dp) * dp
    reduce_peak = e * max(local + dense_shard, dense_shard + n + wide)
    step_peak = e * (dense_shard + wide) + (expert_step_grads(model, layout, pieces) or 0)     # mixed: fp32 too
    stage["category_peaks"]["grads"] = max(reduce_peak, step_peak)
    if not stage["activations"]:                      # the peak is the optimizer step: the shards alone
        shards = e * (dense_shard + wide - pad // dp)
        stage["grads"], stage["total"] = stage["grads"] + shards, stage["total"] + shards
    others = stage["total"] - stage["grads"] - stage["activations"]
    if others + reduce_peak > stage["total"]:         # the reduce-scatters, activations freed
        stage.update(grads=reduce_peak, activations=0, total=others + reduce_peak)


def _no_buffers(layout):
    return replace(layout, extras={**layout.extras, "no_ddp_buffers": True})


def predict_memory(model, layout, accounting="minitrain"):
    """{'stages': per pipeline stage {category: bytes at the peak moment, 'total': their sum, the peak,
    'category_peaks': {category: its own peak}}, 'heaviest': the stage whose rank holds the most}."""
    if accounting not in ("minitrain", "paper"):
        raise ValueError(f"accounting must be 'minitrain' or 'paper', got {accounting!r}")
    stages = minitrain_memory(model, layout) if accounting == "minitrain" else paper_memory(model, layout)
    heaviest = max(range(len(stages)), key=lambda i: stages[i]["total"])
    return {"stages": stages, "heaviest": heaviest}

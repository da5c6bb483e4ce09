"""Bytes per rank by category (params, grads, optimizer_state, activations, comm_buffers), two accountings.

paper: the papers' assumptions, to reproduce their tables. Model states are ZeRO's (Rajbhandari et al.
2020, Figure 1): (2 + 2 + K)Ψ with K = 12 (mixed-precision Adam), sharded by stage over N_d
(minitrain.parallel.zero_memory, the same code the ZeRO tests use). Activations per transformer layer
are Korthikanti et al. (2022) Table 2 (16-bit values, 1-byte dropout masks): sbh(34 + 5as/h) alone;
TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t·(34 + 5as/h); selective recompute sbh(10 + 24/t), with SP
34sbh/t; full recompute 2sbh (2sbh/t with SP). A pipeline stage keeps its layers' activations for
every micro-batch in flight (the schedule's own action list says how many). Extras (sec. 4 as we read
it): the embedding's dropout mask sbh/t per micro-batch on the first stage; the last LayerNorm's and the
LM head's inputs (2sbh/t each) and the fp32 logits 4sbV/t on the last.

minitrain: the bytes minitrain.memory's ledger counts, its peak per category: step_walk replays
one step as the ledger sees it, pipeline_walk a stage along its schedule; what each layer keeps for
backward is plan/activations.py's. DDP holds two bucket copies of the gradients (2Ψ·b), ZeRO-1 a flat
gradient and a shard scratch, ZeRO-2 a staging buffer of Ψ, ZeRO-3 one gathered unit and two staging
buffers at a time; mixed precision counts the fp32 gradients while the optimizer steps.
"""
from dataclasses import replace
from functools import lru_cache

from ..parallel.pipeline import get_schedule
from ..parallel.pipeline.partition import counted_costs, stage_layout
from ..parallel.zero_memory import model_state_bytes
from .activations import gpt_pieces, mlp_pieces
from .experts import expert_params, expert_params_per_rank, paper_layer_bytes, zero_expert_extra
from .layout import PRECISIONS

CATEGORIES = ("params", "grads", "optimizer_state", "activations", "comm_buffers")


# ---------------------------------------------------------------- the papers' formulas
def korthikanti_layer_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def paper_model_states(psi, dp, zero, offload=False):
    states = model_state_bytes(psi, dp, zero, param_bytes=2, grad_bytes=2, k=12)
    if offload:                        # ZeRO-Offload: the optimizer's K bytes live on the host
        states = {**states, "optimizer_state": 0}
    return states


# ---------------------------------------------------------------- model states, minitrain's way
def optimizer_bytes(n, layout):
    """Optimizer state for n parameters: Adam's two moments (SGD's one momentum) in fp32 or fp64, plus
    fp32 master weights under mixed precision or --offload (which puts all of it on the host)."""
    e = PRECISIONS[layout.precision]
    state = 4 if layout.mixed else e
    moments = 1 if layout.optimizer == "sgd" else 2
    return 0 if layout.offload else n * state * (moments + (1 if layout.mixed else 0))


def fp32_step_grads(n, layout):
    """MixedPrecisionOptimizer counts the fp32 copy of the gradients while it steps (on the host if offloaded)."""
    return 4 * n if layout.mixed and not layout.offload else 0


def model_states_at_rest(n, layout):
    """``plan params``: what minitrain holds for n parameters at the optimizer step, without the
    layer-dependent transients (ZeRO-3's gathered unit and staging buffers need the layers' sizes)."""
    e, z, N = PRECISIONS[layout.precision], layout.zero, layout.dp
    pad = -(-n // N) * N if z else n
    state_n = n if z == 0 else pad // N
    row = {"params": e * (pad // N if z == 3 else pad), "optimizer_state": optimizer_bytes(state_n, layout),
           "grads": e * {0: n, 1: pad, 2: pad // N, 3: pad // N}[z] + fp32_step_grads(state_n, layout),
           "activations": 0, "comm_buffers": {0: 2 * e * n, 1: e * pad // N, 2: e * pad, 3: 0}[z]}
    if layout.offload and z == 3:                 # FSDP offload_params: shards and their gradients on the host
        row.update(params=0, grads=0)
    return {**{c: int(row[c]) for c in CATEGORIES}, "total": int(sum(row.values()))}


# ---------------------------------------------------------------- one step as the ledger sees it
def step_walk(pieces, layout, dp):
    """Peak bytes per category, of the total, and each category at the total's peak, for a rank that runs
    every piece on one micro-batch: forward, ``zero_grad`` (the jobs call it after forward: last step's
    gradients are alive until then), backward in reverse, the optimizer step. ZeRO stage ``layout.zero``
    over ``dp`` ranks."""
    e = PRECISIONS[layout.precision]
    z, n, N, host = layout.zero, sum(p.params for p in pieces), dp, layout.offload
    pad = -(-n // N) * N if z else n                          # ZeRO-1/2: one flat buffer padded to N
    unit_pad = lambda u: -(-sum(u) // N) * N                  # noqa: E731  ZeRO-3: one flat buffer per unit
    units = [u for p in pieces for u in p.units]
    shards = sum(unit_pad(u) for u in units) // N if z == 3 else 0
    state_n = {0: n, 1: pad // N, 2: pad // N, 3: shards}[z]  # parameters this rank's optimizer steps
    live = dict.fromkeys(CATEGORIES, 0)
    peak = dict.fromkeys(CATEGORIES, 0)
    peak_total = 0
    at_peak = dict.fromkeys(CATEGORIES, 0)

    def moment(**extra):
        nonlocal peak_total, at_peak
        now = {c: live[c] + extra.get(c, 0) for c in CATEGORIES}
        for c in CATEGORIES:
            peak[c] = max(peak[c], now[c])
        if sum(now.values()) > peak_total:
            peak_total, at_peak = sum(now.values()), now

    # what the previous step left: parameters, optimizer state, gradients (set to None after forward)
    live["params"] = e * {0: n, 1: pad, 2: pad, 3: (0 if host else shards) + len(units)}[z]  # + 0-d placeholders
    live["optimizer_state"] = optimizer_bytes(state_n, layout)
    grads_prev = {0: e * n, 1: e * pad, 2: e * pad // N, 3: 0 if host else e * shards}[z]
    live["grads"] = grads_prev
    # (ExpertDataParallel's buckets hold the dense gradients: the experts' are reduced over their own group)
    ddp_buckets = 0 if layout.local_sgd_every or layout.extras.get("no_ddp_buffers") else \
        2 * e * (n - layout.extras.get("ddp_excluded_params", 0))
    live["comm_buffers"] = {0: ddp_buckets, 1: e * pad // N, 2: e * pad, 3: 0}[z]
    live["activations"] = sum(p.shared for p in pieces)
    for p in pieces:                                          # forward (ZeRO-3: one unit gathered at a time)
        if z == 3 and p.units:
            moment(params=e * max(unit_pad(u) for u in p.units))
        live["activations"] += p.kept
        moment(params=e * unit_pad(p.units[-1]) if z == 3 and p.units else 0)
    if z != 1:
        live["grads"] -= grads_prev                           # zero_grad (ZeRO-1 zeroes its flat buffer in place)
    staging_prev = shard_prev = 0
    for p in reversed(pieces):                                # backward
        below = live["activations"] - p.kept
        live["activations"] = below + p.peak                  # recomputed: its layers' activations again
        for q in reversed(p.parts):
            if z == 3:      # per unit: gathered again, one full gradient, its staging beside the previous one's
                for u in reversed(q.units):
                    gathered = 0 if p.unhooked else e * unit_pad(u)
                    moment(params=gathered, grads=e * max(u), comm_buffers=e * unit_pad(u) + staging_prev)
                    live["grads"] += 0 if host else shard_prev    # the previous unit's reduce-scatter completes
                    staging_prev, shard_prev = e * unit_pad(u), e * unit_pad(u) // N
            elif z == 2:
                moment(grads=e * max(q.sizes, default=0))     # one full gradient at a time, then staged
            else:
                moment()
                live["grads"] += e * q.params if z == 0 else 0
            if q is not p:
                live["activations"] -= q.kept
        live["activations"] = below
    live["grads"] = {0: e * n, 1: e * pad, 2: e * pad // N, 3: 0 if host else e * shards}[z]
    moment()
    moment(grads=fp32_step_grads(state_n, layout))            # the optimizer step (mixed: fp32 gradients)
    return peak, peak_total, at_peak


def pipeline_walk(actions, chunks, layout, local_params, others):
    """Peak bytes for one pipeline stage (per category, total, each category at the total's peak): its
    actions in the schedule's order. A forward adds its chunk's kept activations; a backward goes through
    its pieces in reverse (recomputed ones at their peak), creating their gradients (None before the step)
    the first time, then frees the chunk. ``chunks``: chunk -> list of Pieces; ``others``: parameter
    tensors of other stages (0-d placeholders). The moments are (activations, gradients) pairs, the
    worst by their sum (then by activations, so that both walks pick the same)."""
    e = PRECISIONS[layout.precision]
    # ZeRO on the stage (parallel/zero_3d.py): a flat gradient buffer of the whole stage through the step
    # (stage 1 keeps it between steps, 2 and 3 a shard of it, which the reduce-scatter lands in; stage 3
    # also keeps a shard of the parameters and gathers the stage once per step)
    z = layout.zero if layout.dp > 1 else 0
    zero1 = z >= 1
    pad = -(-local_params // layout.dp) * layout.dp if zero1 else local_params
    g = e * pad if zero1 else 0
    if len(chunks) == 1 and not isinstance(actions, list):     # one chunk: the schedule's in-flight counts
        K, F, A, G, shared = _chunk_backward(tuple(chunks[0]), 0 if zero1 else e)
        # the worst moments are backwards: a forward never has more in flight than the next backward,
        # and a backward holds at least its own micro-batch's kept bytes (A >= K, F >= K)
        b_first, b_later = actions
        act_peak = (max(b_first, b_later) - 1) * K + A
        dyn = _worst(((b_first - 1) * K + F[0], g + F[1]), ((b_later - 1) * K + A, g + G) if b_later else (0, 0))
        g += G
    else:
        kept, first, again, grads, shared = {}, {}, {}, {}, 0
        for c, ps in chunks.items():
            kept[c], first[c], again[c], grads[c], sh = _chunk_backward(tuple(ps), 0 if zero1 else e)
            shared += sh
        act = act_peak = 0
        dyn = (0, 0)
        seen = set()
        split = any(a.kind == "W" for a in actions)       # zero-bubble: activations live until W
        for a in actions:
            if a.kind == "F":
                act += kept[a.chunk]
                act_peak, dyn = max(act_peak, act), _worst(dyn, (act, g))
                continue
            if split and a.kind == "B":
                continue
            others_act = act - kept[a.chunk]
            fresh = a.chunk not in seen
            act_peak = max(act_peak, others_act + again[a.chunk])
            dyn = _worst(dyn, (others_act + first[a.chunk][0], g + first[a.chunk][1]) if fresh
                         else (others_act + again[a.chunk], g))
            act = others_act
            if fresh:
                seen.add(a.chunk)
                g += grads[a.chunk]
    stepped = pad // layout.dp if zero1 else local_params      # what this rank's optimizer steps
    step_grads = fp32_step_grads(stepped, layout)
    shard_g = e * pad // layout.dp if z >= 2 else 0             # stages 2, 3: the gradient shard
    shard_p = e * pad // layout.dp + e if z == 3 else 0         # stage 3: the parameter shard, a 0-d placeholder
    peak = {"params": e * (pad + others) + shard_p, "grads": g + step_grads + shard_g, "activations": act_peak + shared,
            "optimizer_state": optimizer_bytes(stepped, layout), "comm_buffers": e * pad // layout.dp if z == 1 else 0}
    at_peak = {**peak, "activations": dyn[0] + shared, "grads": dyn[1]}    # (the shard made again by the step's end)
    if g + step_grads > sum(dyn) + shared:                     # the optimizer step: its activations are freed
        at_peak.update(activations=0, grads=g + step_grads + shard_g)
    return peak, sum(at_peak.values()), at_peak


def _worst(a, b):
    """The heavier of two (activations, gradients) moments."""
    return max(a, b, key=lambda m: (m[0] + m[1], m[0]))


@lru_cache(maxsize=4096)
def _chunk_backward(pieces, grad_bytes):
    """A chunk's kept activations; its worst (activations, new gradients) inside its first backward and
    its worst activations in a later one; its gradients; its step-long shared bytes."""
    kept = below = sum(p.kept for p in pieces)
    new, moments = 0, []
    for p in reversed(pieces):
        below -= p.kept
        moments.append((below + p.peak, new))
        new += grad_bytes * p.params
    moments.append((0, new))
    return (kept, max(moments, key=lambda m: (m[0] + m[1], m[0])), max(a for a, _ in moments), new,
            sum(p.shared for p in pieces))


@lru_cache(maxsize=4096)
def _count(pieces):
    """(parameters, parameter tensors) of some pieces."""
    return sum(p.params for p in pieces), sum(len(p.sizes) for p in pieces)


@lru_cache(maxsize=256)
def stage_bounds(sizes, schedule, p, v):
    """(bounds, where) as the runtime lays out layers of these parameter counts (pipeline/partition.py's
    ``counted_costs`` and ``stage_layout``: the same calls): virtual stage k holds layers bounds[k]:bounds[k+1] on rank and chunk
    where[k]. Paper-scale models (beyond what the runtime's dynamic programme is for) get Megatron's even
    split of the blocks."""
    parts = p * v
    points = None
    if len(sizes) ** 2 * parts > 60_000:                     # Megatron's even split for paper-scale models
        per = (len(sizes) - 2) // parts
        points = [1 + per * k for k in range(1, parts)]
    bounds, where = stage_layout(counted_costs(sizes), schedule, p, v, split_points=points)
    return tuple(bounds), tuple(where)


@lru_cache(maxsize=512)
def _schedule(name, p, m, v):
    return get_schedule(name, p, m, chunks=v)


@lru_cache(maxsize=4096)
def in_flight(name, p, m, stage):
    """For a one-chunk schedule, stage ``stage``'s micro-batches in flight at its first backward and the
    most at a later backward (0: none) — all that the memory walk needs when chunks are alike.
    Beyond m = 4p they are extrapolated from the schedule at 2p and 3p micro-batches (constant for
    1F1B, m for GPipe: linear once every stage is in its steady state; tests check both)."""
    if m > 4 * p:
        a, b = _in_flight(name, p, 2 * p, stage), _in_flight(name, p, 3 * p, stage)
        return tuple(int(x + (y - x) * (m - 2 * p) / p) for x, y in zip(a, b))
    return _in_flight(name, p, m, stage)


@lru_cache(maxsize=4096)
def _in_flight(name, p, m, stage):
    return counts_in_flight(_schedule(name, p, m, 1)[stage])


def counts_in_flight(actions):
    """(in flight at the first backward, the most at a later one): see ``in_flight``. Zero-bubble
    schedules keep a micro-batch's activations until its W (the deferred weight gradients need the
    layers' inputs), so there W is the backward that frees them and B frees nothing."""
    n = b_first = b_later = 0
    split = any(a.kind == "W" for a in actions)
    for a in actions:
        if a.kind == "F":
            n += 1
            continue
        if split and a.kind == "B":
            continue
        b_first, b_later = (b_first, max(b_later, n)) if b_first else (n, b_later)
        n -= 1
    return b_first, b_later


def stage_chunks(pieces, layout, paper=False):
    """Per stage, chunk -> its pieces, cut and placed as the runtime does (``stage_bounds``: balanced by
    counted F + B + W cost, the schedule's placement: the interleaved loop, zbv's V), or for the paper's accounting
    L/(p·v) blocks per virtual stage (Megatron's rule)."""
    p, v = layout.pp, layout.chunks
    bounds, where = stage_bounds(tuple(x.params for x in pieces), layout.schedule, p, v)
    if paper:
        per = (len(pieces) - 2) // (p * v)
        bounds = [0] + [1 + per * k for k in range(1, p * v)] + [len(pieces)]
    stages = [dict() for _ in range(p)]
    for virtual, (rank, chunk) in enumerate(where):
        stages[rank][chunk] = pieces[bounds[virtual]:bounds[virtual + 1]]
    return stages


def _stage_result(peak, total, at_peak):
    """Each category at the peak moment (they sum to the total), and each category's own peak beside."""
    parts = {c: int(round(at_peak[c])) for c in CATEGORIES}
    return {**parts, "total": sum(parts.values()), "category_peaks": {c: int(round(peak[c])) for c in CATEGORIES}}


def _one_moment(row):
    """A row whose categories are held all at once (model states at rest, the papers' sums)."""
    parts = {c: int(round(row.get(c, 0))) for c in CATEGORIES}
    return {**parts, "total": sum(parts.values()), "category_peaks": dict(parts)}


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
    pieces = (mlp_pieces(model, layout, b, in_pipeline=True) if model.kind == "mlp"
              else gpt_pieces(model, layout, b))
    out = []
    tensors = sum(len(x.sizes) for x in pieces)
    for s, chunks in enumerate(stage_chunks(pieces, layout)):
        local, mine = _count(tuple(x for ps in chunks.values() for x in ps))
        others = tensors - mine if layout.pp > 1 else 0
        actions = (in_flight(layout.schedule, layout.pp, layout.microbatches, s) if layout.chunks == 1
                   else _schedule(layout.schedule, layout.pp, layout.microbatches, layout.chunks)[s])
        out.append(_experts_sharded(_stage_result(*pipeline_walk(actions, chunks, layout, local, others)), model,
                                    layout, [x for ps in chunks.values() for x in ps]))
    return out


def _experts_sharded(stage, model, layout, pieces):
    """A stage's bytes with its routed experts' states sharded by ZeRO over dp/ep, not dp (plan/experts.py)."""
    if model.kind != "gpt" or not model.moe_experts or not layout.zero or layout.ep == 1:
        return stage
    extra = zero_expert_extra(model, layout, sum(1 for x in pieces if x.name == "moe_block")) \
        if model.kind == "gpt" else {}
    for c, n in extra.items():
        stage[c] += n
        stage["category_peaks"][c] += n
        stage["total"] += n
    return stage


def _no_buffers(layout):
    return replace(layout, extras={**layout.extras, "no_ddp_buffers": True})


def paper_memory(model, layout):
    """Per stage, the papers' accounting (module docstring)."""
    if model.kind != "gpt":
        states = paper_model_states(model.num_parameters(), layout.dp, layout.zero, layout.offload)
        return [_one_moment(states)]
    t, b, s, h = layout.tp, layout.micro_batch_size, model.block_size // layout.cp, model.n_embd
    per_layer = paper_layer_bytes(model, layout, b)
    per_moe_layer = paper_layer_bytes(model, layout, b, moe=True) if model.moe_experts else 0
    pieces = gpt_pieces(model, layout, b)
    schedule = _schedule(layout.schedule, layout.pp, layout.microbatches, layout.chunks) if layout.chunks > 1 else None
    out = []
    for st, chunks in enumerate(stage_chunks(pieces, layout, paper=True)):
        psi = sum(x.params for ps in chunks.values() for x in ps)
        moe_blocks = sum(1 for ps in chunks.values() for x in ps if x.name == "moe_block")
        experts = moe_blocks * (model.moe_experts // layout.ep) * expert_params(model)   # over dp/ep ranks
        states = paper_model_states(psi - experts, layout.dp, layout.zero, layout.offload)
        if experts:
            more = paper_model_states(experts, layout.dp // layout.ep, layout.zero, layout.offload)
            states = {c: states.get(c, 0) + more.get(c, 0) for c in set(states) | set(more)}
        bytes_of = {}
        for c, ps in chunks.items():
            blocks = sum(1 for x in ps if x.name == "block") + sum(per_moe_layer / per_layer for x in ps
                                                                    if x.name == "moe_block")
            extra = sum(s * b * h / t for x in ps if x.name == "embedding")
            extra += sum(4 * s * b * h / t + 4 * s * b * model.vocab_size / t for x in ps if x.name == "head")
            bytes_of[c] = blocks * per_layer + extra
        if layout.chunks == 1:
            worst = bytes_of[0] * max(in_flight(layout.schedule, layout.pp, layout.microbatches, st))
        else:
            act = worst = 0
            for action in schedule[st]:
                act += bytes_of[action.chunk] if action.kind == "F" else -bytes_of[action.chunk]
                worst = max(worst, act)
        row = {**{c: states.get(c, 0) for c in CATEGORIES}, "activations": worst, "comm_buffers": 0}
        out.append(_one_moment(row))
    return out


def predict_memory(model, layout, accounting="minitrain"):
    """{'stages': per pipeline stage {category: bytes at the peak moment, 'total': their sum, the peak,
    'category_peaks': {category: its own peak}}, 'heaviest': the stage whose rank holds the most}."""
    if accounting not in ("minitrain", "paper"):
        raise ValueError(f"accounting must be 'minitrain' or 'paper', got {accounting!r}")
    stages = minitrain_memory(model, layout) if accounting == "minitrain" else paper_memory(model, layout)
    heaviest = max(range(len(stages)), key=lambda i: stages[i]["total"])
    return {"stages": stages, "heaviest": heaviest}

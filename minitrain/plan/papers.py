"""Memory per rank as the papers count it, to reproduce their tables. Model states are ZeRO's (Rajbhandari
et al. 2020, Figure 1): (2 + 2 + K)Ψ with K = 12 (mixed-precision Adam), sharded by stage over N_d
(minitrain.parallel.zero_memory, the same code the ZeRO tests use). Activations per transformer layer
are Korthikanti et al. (2022) Table 2 (16-bit values, 1-byte dropout masks): sbh(34 + 5as/h) alone;
TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t·(34 + 5as/h); selective recompute sbh(10 + 24/t), with SP
34sbh/t; full recompute 2sbh (2sbh/t with SP). A pipeline stage keeps its layers' activations for
every micro-batch in flight (the schedule's own action list says how many). Extras (sec. 4 as we read
it): the embedding's dropout mask sbh/t per micro-batch on the first stage; the last LayerNorm's and the
LM head's inputs (2sbh/t each) and the fp32 logits 4sbV/t on the last.
"""
from ..parallel.zero_memory import model_state_bytes
from .activations import gpt_pieces
from .experts import expert_params, paper_layer_bytes
from .stages import _schedule, in_flight, stage_chunks
from .states import CATEGORIES, _one_moment


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
            frees = "W" if any(a.kind == "W" for a in schedule[st]) else "B"   # zero-bubble: held until W
            for action in schedule[st]:
                if action.kind in ("F", frees):
                    act += bytes_of[action.chunk] if action.kind == "F" else -bytes_of[action.chunk]
                worst = max(worst, act)
        row = {**{c: states.get(c, 0) for c in CATEGORIES}, "activations": worst, "comm_buffers": 0}
        out.append(_one_moment(row))
    return out

"""What a step counts before any pricing: the matmul FLOPs of one iteration of the whole model (Narayanan
et al. 2021, with recomputation: 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h))), the graph nodes the rank that records
the most records, and each layer's parameter tensors as the pipeline cuts the layers.
"""
from .stages import stage_bounds
from .work import gpt_block_work, gpt_ends_work, mlp_layer_work, mlp_recompute, recorded_nodes


def flops_per_iteration(model, layout):
    """Matmul FLOPs of one step of the whole model (all ranks): forward, backward (2x), and the forward
    again where it is recomputed. GPT with full recomputation: Narayanan et al.'s 96Bslh²(1 + s/6h + V/16lh)."""
    B = layout.batch_size
    if model.kind == "params":
        return 6 * B * model.num_params
    if model.kind == "mlp":
        fwd = sum(2 * B * i * o for i, o in model.linears())
        first = 2 * B * model.linears()[0][0] * model.linears()[0][1]       # no gradient for the input
        extra = fwd - 2 * B * model.sizes[-2] * model.sizes[-1] if layout.recompute == "full" else 0
        return 3 * fwd - first + extra
    s, h, L, f = model.block_size, model.n_embd, model.n_layer, model.ffn
    v_pad = -(-model.vocab_size // layout.tp) * layout.tp
    attention = 8 * B * s * h * h + 4 * B * s * s * h
    layer = attention + 4 * B * s * h * f                                    # one layer's forward
    recompute = {"full": layer, "selective": 4 * B * s * s * h}.get(layout.recompute, 0)
    dense = (L - model.num_moe_layers()) * (3 * layer + recompute)
    if model.moe_experts:                  # the router, k routed experts per token (capacity: fewer), the shared
        from .experts import routed_rows, routed_tokens
        b = layout.micro_batch_size
        k = routed_rows(model, layout, b) / (b * routed_tokens(model, layout))   # rows per token: k dropless
        moe = attention + 2 * B * s * h * model.moe_experts + 4 * B * s * h * model.expert_ffn * (k + model.moe_shared)
        dense += model.num_moe_layers() * (3 * moe + {"full": moe}.get(layout.recompute, recompute))
    return dense + 6 * B * s * h * v_pad


def predict_nodes(model, layout, machine=None):
    """Graph nodes the rank that records the most records per step (the jobs report theirs)."""
    if model.kind == "params":
        return 0
    device = (machine or {}).get("device", "cpu")
    if model.kind == "mlp":
        works = _mlp_works(model, layout, layout.micro_batch_size)
    else:
        block = gpt_block_work(model, layout, layout.micro_batch_size, device)
        moe = gpt_block_work(model, layout, layout.micro_batch_size, device, moe=True) if model.moe_experts else block
        emb, head = gpt_ends_work(model, layout, layout.micro_batch_size, device)
        works = [emb] + [moe if model.is_moe_layer(i) else block for i in range(model.n_layer)] + [head]
    counts = tuple(sum(x) for x in _layer_sizes(model, layout))
    p, v = layout.pp, layout.chunks
    bounds, where = stage_bounds(counts, layout.schedule, p, v)          # as the runtime cuts and places them
    per_stage = [0] * p
    for (lo, hi), (rank, _) in zip(zip(bounds, bounds[1:]), where):
        per_stage[rank] += recorded_nodes(works[lo:hi], layout.microbatches)
    return max(per_stage)


def _layer_sizes(model, layout):
    """Each layer's parameter tensors (element counts), as the pipeline cuts the layers: one entry per tensor
    (the optimizer, the clip and the gradients' accumulation pay per tensor), as GPT3D's stages hold them."""
    if model.kind == "mlp":
        return [[i * o, o] if k == "linear" else [] for k, i, o in model.modules()]
    from .experts import moe_mlp_sizes
    h, t, v, f = model.n_embd, layout.tp, -(-model.vocab_size // layout.tp), model.ffn
    attention = [h, h, 3 * h * h // t, 3 * h // t, h * h // t, h, h, h]      # ln_1, qkv, proj (its bias whole), ln_2
    block = attention + [h * f // t, f // t, f * h // t, h]
    moe = attention + moe_mlp_sizes(model, layout) if model.moe_experts else block
    return ([[v * h, model.block_size * h]] + [moe if model.is_moe_layer(i) else block for i in range(model.n_layer)]
            + [[h, h, v * h]])


def sp_replicated_sizes(model, layout):
    """Each layer's parameter tensors (element counts) that every tp rank holds whole and, under sequence
    parallelism, gives a partial gradient over its own tokens (TensorParallelGPT.replicated: wpe, the
    LayerNorms, the row-parallel Linears' biases, an MoE layer's router and experts), as _layer_sizes lists
    the layers."""
    from .experts import moe_mlp_sizes
    h = model.n_embd
    attention = [h, h, h, h, h]                                  # ln_1, the attention's c_proj bias, ln_2
    moe = attention + moe_mlp_sizes(model, layout) if model.moe_experts else None
    return ([[model.block_size * h]] + [moe if model.is_moe_layer(i) else attention + [h]
                                         for i in range(model.n_layer)] + [[h, h]])


def sp_replicated_per_stage(model, layout):
    """Per pipeline rank (its chunks together), the elements and tensors of its replicated parameters'
    gradients that sequence parallelism sums over tp once a step (GPT3D: all_reduce_replicated_grads).
    Memoized: a --search prices thousands of layouts with the same stages."""
    key = (model, layout.tp, layout.ep, layout.pp, layout.chunks, layout.schedule)
    if key not in _SP_REPLICATED:
        if len(_SP_REPLICATED) > 4096:
            _SP_REPLICATED.clear()
        _SP_REPLICATED[key] = _sp_replicated_per_stage(model, layout)
    return _SP_REPLICATED[key]


_SP_REPLICATED = {}


def _sp_replicated_per_stage(model, layout):
    sizes = sp_replicated_sizes(model, layout)
    bounds, where = stage_bounds(tuple(sum(x) for x in _layer_sizes(model, layout)), layout.schedule,
                                 layout.pp, layout.chunks)
    stages = [[0, 0] for _ in range(layout.pp)]
    for (lo, hi), (rank, _) in zip(zip(bounds, bounds[1:]), where):
        stages[rank][0] += sum(sum(x) for x in sizes[lo:hi])
        stages[rank][1] += sum(len(x) for x in sizes[lo:hi])
    return [tuple(x) for x in stages]


def _mlp_works(model, layout, rows):
    works = mlp_layer_work(model, layout, rows)
    return mlp_recompute(works, layout) if layout.recompute == "full" else works

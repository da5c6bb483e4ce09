"""Seconds of each GPT layer on one rank, per micro-batch: forward and backward compute (plan/work.py's
Work priced by plan/costs.py) and their communication, wall and busy: tensor parallelism's collectives
(tp_collectives: 2 all-reduces of b·s·h per block each way, or with sequence parallelism 4 all-gathers or
reduce-scatters forward and 6 backward: Korthikanti et al. 2022), context parallelism's exchanges
(plan/context.py) and the experts' all-to-alls (plan/experts.py). Memoized: a --search prices thousands of layouts with the same layers.
"""
from .alpha_beta import collective
from .layout import PRECISIONS
from .work import gpt_block_work, gpt_ends_work, runs_nn_gpt


def gpt_layer_costs(model, layout, rows, c, machine):
    """[embedding, blocks..., head]: (forward compute, forward comm, backward compute, backward comm, the
    two comms' busy parts, and of the backward's compute W's part: the weights' gradients) seconds; the
    tensor-parallel collectives are tp_collectives'."""
    key = (model, rows, layout.tp, layout.sequence_parallel, layout.recompute, layout.precision, id(machine),
           c.slowdown, c.threads, c.fresh, bool(layout.extras.get("parallel_job")) or layout.world > 1,
           layout.cp, layout.cp_method, layout.ep, layout.dp, layout.moe_load, bool(layout.extras.get("moe_dp_job")))
    if key not in _LAYER_COSTS:
        _LAYER_COSTS[key] = _gpt_layer_costs(model, layout, rows, c, machine)
        if len(_LAYER_COSTS) > 4096:
            _LAYER_COSTS.pop(next(iter(_LAYER_COSTS)))
    return _LAYER_COSTS[key]


_LAYER_COSTS = {}


def _gpt_layer_costs(model, layout, rows, c, machine):
    def comm(busy):                                    # (each right after the layer's arithmetic)
        return [tuple(sum(collective(machine, name, nbytes, p, layout.tp, busy=busy, after_compute=True)
                          for name, nbytes, p in calls) for calls in layer)
                for layer in tp_collectives(model, layout, rows)]
    device = machine.get("device", "cpu")
    block_f, block_b = gpt_block_work(model, layout, rows, device)
    (emb_f, emb_b), (head_f, head_b) = gpt_ends_work(model, layout, rows, device)
    wall, own = comm(False), comm(True)
    emb, block, head = [(c.seconds(f), wall[i][0], c.seconds(b), wall[i][1], own[i][0], own[i][1], weights(c, b))
                        for i, (f, b) in enumerate(((emb_f, emb_b), (block_f, block_b), (head_f, head_b)))]
    wall_cp, own_cp = axes_comm(model, layout, rows, machine, False), axes_comm(model, layout, rows, machine, True)
    moe = block
    if model.moe_experts:              # tp: the attention's collectives only (the experts are whole on every rank)
        moe_f, moe_b = gpt_block_work(model, layout, rows, device, moe=True)
        moe = _plus((c.seconds(moe_f), block[1] / 2, c.seconds(moe_b), block[3] / 2, block[4] / 2, block[5] / 2,
                     weights(c, moe_b)), wall_cp[1], own_cp[1])
    block = _plus(block, wall_cp[0], own_cp[0])
    return [emb] + [moe if model.is_moe_layer(i) else block for i in range(model.n_layer)] + [head]


def tp_collectives(model, layout, rows):
    """[embedding, block, head]: (forward, backward) lists of (name, bytes, ranks) of the tensor-parallel
    collectives of one micro-batch (Megatron's f and g; Korthikanti et al. 2022 with sequence parallelism).
    Without SP: g all-reduces b·s·h after the embedding and each row-parallel Linear, f before each
    column-parallel one in backward. With SP: g is a reduce-scatter (its backward an all-gather) and f an
    all-gather (AllGatherLinear), whose backward gathers the input again for the weight's gradient and
    reduce-scatters the input's. The vocabulary-parallel loss: three all-reduces of b·s. Full recomputation
    runs a block's forward collectives again in its backward."""
    if runs_nn_gpt(layout):                                             # nn.GPT: no f, g
        return [([], [])] * 3
    t, e = layout.tp, PRECISIONS[layout.precision]
    act = rows * model.block_size // layout.cp * model.n_embd * e
    loss = [("ring_all_reduce", rows * model.block_size // layout.cp * 8, t)] * 3
    if layout.sequence_parallel:
        f, g = [("ring_all_gather", act, t)], [("ring_reduce_scatter", act, t)]
        f_back, g_back = [("ring_all_gather", act, t), ("ring_reduce_scatter", act, t)], [("ring_all_gather", act, t)]
    else:
        f, g, f_back, g_back = [], [("ring_all_reduce", act, t)], [("ring_all_reduce", act, t)], []
    block = (2 * (f + g), 2 * (g_back + f_back))                       # (c_attn, c_proj; c_fc, c_proj)
    if layout.recompute == "full":
        block = (block[0], block[0] + block[1])
    return [(g, g_back), block, (f + loss, f_back)]


def weights(c, backward):
    """Seconds of the part of a backward's compute that makes the weights' gradients (a zero-bubble
    schedule's W; plan/work.py counts it as Work.w)."""
    return c.seconds(backward.w) if backward.w is not None else 0.0


def _plus(costs, wall, own):
    """A layer's costs with more communication (forward, backward) added, wall and busy."""
    f, fm, b, bm, fo, bo, w = costs
    return (f, fm + wall[0], b, bm + wall[1], fo + own[0], bo + own[1], w)


def axes_comm(model, layout, rows, machine, busy):
    """((forward, backward) seconds of context parallelism's communication in a block, (the same) in an MoE
    block with its four all-to-alls and the forward's exchange of split sizes added (plan/experts.py), and under
    cp its balancing loss's counts summed over the cp ranks (with a capacity, the choices gathered too; under
    sequence parallelism over the cp x tp ranks, and P summed over the tp ranks). Ring:
    cp-1 hops of K and V forward, of K, V, dK and dV backward and a last of dK and dV, a sendrecv each array;
    Ulysses: four all-to-alls each way; recomputation sends the forward's again in backward (full: the MoE
    block's all-to-alls and counts too; selective recomputes the attention core alone). The ep ranks are
    consecutive dp ranks."""
    from .context import cp_block_bytes
    from .experts import all_to_all_bytes, local_groups, routed_tokens
    c, t, ep = layout.cp, layout.tp, layout.ep
    fwd = bwd = 0.0
    if c > 1:
        block = cp_block_bytes(model, layout, rows)
        if layout.cp_method == "ring":             # one sendrecv per array passed on (ring.py's _pass_on)
            one = collective(machine, "p2p", block, 2, c * t, busy=busy, after_compute=True)
            fwd, bwd = (c - 1) * 2 * one, ((c - 1) * 4 + 2) * one    # K, V; K, V, dK, dV, and dK, dV home
        else:
            fwd = bwd = 4 * collective(machine, "all_to_all", block, c, c * t, busy=busy, after_compute=True)
        if layout.recompute != "none":             # the recomputed core (selective) or block (full) sends it again
            bwd += fwd
    a2a = counts = 0.0
    if model.moe_experts and ep > 1:
        whole = all_to_all_bytes(model, layout, rows) * ep / (ep - 1)      # the rows' bytes, to and from all
        a2a = 2 * collective(machine, "all_to_all", whole, ep, ep * c * t, busy=busy, after_compute=True)
        # before the forward's dispatch, the split sizes: the (ep, E/ep) int64 count table, an equal-block
        # all-to-all (expert_parallel_moe.split_sizes; the backward's all-to-alls reverse the same splits)
        counts = collective(machine, "all_to_all", 8 * model.moe_experts, ep, ep * c * t, busy=busy,
                            after_compute=True)
    r = t if layout.sequence_parallel else 1          # sequence parallelism: each tp rank routes its own tokens
    table = local_groups(model, layout) * model.moe_experts * PRECISIONS[layout.precision]      # G x E numbers
    if model.moe_experts and c * r > 1:  # the balancing loss's counts, summed over the cp (x tp) ranks
        counts += collective(machine, "ring_all_reduce", table, c * r, c * t, busy=busy, after_compute=True)
        if model.moe_capacity_factor is not None:     # and the choices of every rank's tokens, to plan a capacity
            whole = 8 * rows * routed_tokens(model, layout) * c * r * model.moe_top_k
            counts += collective(machine, "ring_all_gather", whole, c * r, c * t, busy=busy, after_compute=True)
    if model.moe_experts and r > 1:      # and P, the mean probabilities, summed over tp (identity backward)
        counts += collective(machine, "ring_all_reduce", table, t, t, busy=busy, after_compute=True)
    # full recomputation runs an MoE block's forward again in its backward: its split sizes and all-to-alls too
    again = a2a + counts if layout.recompute == "full" else 0.0
    return (fwd, bwd), (fwd + a2a + counts, bwd + a2a + again)

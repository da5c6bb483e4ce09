"""The planner's mixture of experts with expert parallelism (ep); context parallelism (cp): plan/context.py.

MoE (nn/moe.py; Shazeer et al. 2017, GShard, Switch): a router Linear(h, E) without bias, top-k of E
experts, each the GPT's MLP of width f' (2hf' + f' + h parameters), capacity factor C per group of
tokens (GShard's groups). On a rank with N tokens of a micro-batch, M = N·k rows are routed (dropless),
at most E·G·ceil(C·(N/G)·k/E) with a capacity factor. Expert parallelism (GShard; Megatron-Core's
EP) shards the experts over ep consecutive dp ranks: E/ep experts per rank, the router and the dense
layers replicated; tokens go to their experts' ranks by all-to-all (dispatch) and come back (combine),
and the same two in backward; each sends M·h values of which (ep-1)/ep leave the rank at balance.
Expert gradients are averaged over the dp/ep ranks that hold the same experts, and ZeRO shards the
expert states over those dp/ep ranks (the dense ones over dp). Under tp, GPT3D replicates an MoE layer
on its stage's tp ranks (the experts are not tensor-parallel): each tp rank routes every token, or with
sequence parallelism its own s/t (Megatron-Core's way), so every MoE term below is at N/t tokens and the
layer has no tp collective of its own (the balancing loss's counts and P summed over the tp ranks, G x E
numbers each; with a capacity the choices gathered, as under cp; routed_tokens).

What an MoE layer keeps for backward, counted as the ledger counts it (tests/test_plan_moe.py checks
it against the job): its input N·h (the router's), the softmax's N·E, the gates N·k, the dispatched rows
M·h, each expert's hidden 3·M·f' (c_fc's output, GELU's saved input and output) — a dense MLP's
13·N·h at f = 4h — the combine's gathered rows N·k·h, the balancing loss's 2·E per group and its
scalar. Under ep a rank's experts take the rows the all-to-all brings, M at balance and N·k·L on the
busiest rank of a routing whose load is L (--moe-load: the busiest rank's experts' rows over its own
routed rows N·k, the data's to decide: the jobs measure their run's and plan at it; an untrained router
sends the default GPT's busiest rank 1.6x its share; a capacity that drops rows makes it less, below 1
with one rank's experts); holding more than one expert, it regroups them expert by
expert, a gather whose copy is what the experts' c_fc keep (the rows the all-to-all brought are not kept:
still M·h in all). Its step is the busiest rank's: its experts' work and its all-to-alls grow by L too.

Experts under cp: each rank routes its s/cp tokens, as the GPT job runs them (the balancing loss's
fractions summed over the cp ranks, G x E numbers; with a capacity the ranks' choices all-gathered, N·k
integers, to plan the group's drops as one process does; under ep the ep groups of every cp coordinate
hold the same experts, reduced over dp/ep x cp ranks).
Not modelled (refused in one line): dropout with experts; the impossible layouts (ep not dividing dp or E)
name the nearest valid choice.
GShard's groups (--moe-groups G) are the job's: G a multiple of dp x micro-batches, dividing the global batch.
"""
import math

from .context import check_cp, local_tokens
from .layout import LayoutError, PRECISIONS, _choices, _nearest
from .states import fp32_step_grads, optimizer_bytes


def check_axes(model, layout):
    """Raise LayoutError for the first cp / ep / MoE constraint the layout breaks, naming the nearest valid."""
    check_cp(model, layout)
    ep, E = layout.ep, model.moe_experts
    if ep > 1 and not E:
        raise LayoutError(f"--ep {ep} shards experts, but the model has none (--moe-experts 0): --ep 1")
    if layout.dp % ep:
        valid = [d for d in range(1, layout.dp + 1) if layout.dp % d == 0 and (not E or E % d == 0)]
        raise LayoutError(f"--ep {ep} does not divide --dp {layout.dp} (experts are sharded over blocks of ep "
                          f"consecutive dp ranks); nearest valid --ep: {_choices(_nearest(ep, valid))}")
    dropless = model.moe_capacity_factor is None
    if dropless and ep == 1 and layout.moe_load != 1:
        raise LayoutError(f"--moe-load {layout.moe_load:g} with --ep 1 and no capacity factor: one rank's experts take "
                          f"every routed row, a load of 1; leave --moe-load out")
    if not 0 < layout.moe_load <= ep or (dropless and layout.moe_load < 1):
        raise LayoutError(f"--moe-load {layout.moe_load:g} is the busiest rank's experts' rows over its own routed "
                          f"rows: between {1 if dropless else 0} and {'--ep ' if ep > 1 else ''}{ep}"
                          + (" (below 1 only where a capacity factor drops rows)" if dropless else ""))
    if not E:
        return
    if E % ep:
        valid = [d for d in range(1, E + 1) if E % d == 0 and layout.dp % d == 0]
        raise LayoutError(f"--ep {ep} does not divide --moe-experts {E}; nearest valid --ep: "
                          f"{_choices(_nearest(ep, valid))}")
    if not 1 <= model.moe_top_k <= E:
        raise LayoutError(f"--moe-top-k {model.moe_top_k} must be between 1 and --moe-experts {E}")
    if not 1 <= model.moe_every <= model.n_layer:
        raise LayoutError(f"--moe-every {model.moe_every} exceeds --n-layer {model.n_layer}: no block would be an "
                          f"MoE layer")
    problem = moe_groups_problem(model.moe_groups or layout.dp * layout.microbatches, layout.dp, layout.microbatches,
                                 layout.batch_size)
    if problem:       # the default groups (dp x m) can only fail to split the batch
        raise LayoutError(f"{problem}" + ("" if model.moe_groups else " (its default: one per data-parallel replica "
                                          "and micro-batch)") + " (the job refuses it too)")
    if model.dropout:
        raise LayoutError("--dropout with --moe-experts is not modelled by the planner (the experts' dropout masks): "
                          "--dropout 0")


def routed_tokens(model, layout):
    """Tokens of one sequence an MoE layer on a rank routes: s/cp, and under sequence parallelism s/(cp·t)
    (each tp rank its own piece)."""
    return local_tokens(model, layout) // (layout.tp if layout.sequence_parallel else 1)


def expert_params(model):
    """One expert's parameters: c_fc (h·f' + f'), c_proj (f'·h + h), whole on every tp rank (GPT3D replicates
    an MoE layer on its stage's tp ranks)."""
    h, f = model.n_embd, model.expert_ffn
    return 2 * h * f + f + h


def moe_mlp_sizes(model, layout):
    """An MoE block's MLP as parameter tensors on one rank: the router and the E/ep routed experts and the
    shared ones, replicated on the tp ranks (as GPT3D runs an MoE layer)."""
    h, f = model.n_embd, model.expert_ffn
    expert = [h * f, f, f * h, h]
    return [h * model.moe_experts] + expert * (model.moe_experts // layout.ep + model.moe_shared)


def expert_params_per_rank(model, layout):
    """Routed experts' parameters one rank holds: MoE layers x E/ep x one expert's (what ep shards)."""
    return model.num_moe_layers() * (model.moe_experts // layout.ep) * expert_params(model)


def routed_rows(model, layout, rows):
    """M: rows a rank's experts take for ``rows`` sequences of s/cp tokens: N·k dropless, at most the
    capacity E·G·ceil(C·(N/G)·k/E) over its G groups. At balance a rank receives what it sends."""
    return min(rows * routed_tokens(model, layout) * model.moe_top_k, expert_capacity(model, layout, rows))


def expert_capacity(model, layout, rows):
    """The rows E experts take at most from ``rows`` sequences, E·G·ceil(C·(N/G)·k/E) (inf dropless)."""
    if model.moe_capacity_factor is None:
        return math.inf
    N, k, E = rows * routed_tokens(model, layout), model.moe_top_k, model.moe_experts
    groups = local_groups(model, layout)
    return E * groups * math.ceil(model.moe_capacity_factor * (N // groups) * k / E)


def moe_groups_problem(groups, dp, microbatches, batch_size):
    """Why GShard's ``groups`` cannot route a layout's batches, or None: each micro-batch of each of the dp
    replicas routes whole groups, and each group is whole rows of the global batch (the job and the planner
    refuse the same)."""
    if groups % (dp * microbatches):
        return (f"--moe-groups {groups} is not a multiple of the {dp} data-parallel replicas"
                + (f" x {microbatches} micro-batches" if microbatches > 1 else "") + " (each routes whole groups)")
    if batch_size % groups:
        return f"--batch-size {batch_size} does not split into --moe-groups {groups} groups of whole rows"
    return None


def received_rows(model, layout, rows):
    """Rows this rank's experts take: routed_rows at a load of 1, else its own routed rows N·k times moe_load
    (the busiest rank's experts' rows over its routed ones: above 1 where ep sends it more than an even share,
    below where a capacity drops rows; a routing's load is the data's, so the jobs measure it), at most the
    capacity of the experts (all ep ranks' choices for them)."""
    if layout.moe_load == 1:
        return routed_rows(model, layout, rows)
    routed = rows * routed_tokens(model, layout) * model.moe_top_k
    return min(math.ceil(routed * layout.moe_load), expert_capacity(model, layout, rows))


def local_groups(model, layout):
    """GShard's groups in one micro-batch of a replica: the global batch's over dp x micro-batches (1 by
    default, as the job's)."""
    return max(1, (model.moe_groups or layout.dp * layout.microbatches) // (layout.dp * layout.microbatches))


def moe_kept_values(model, layout, rows):
    """Values an MoE layer keeps for backward (module docstring), for ``rows`` sequences on one rank (the
    busiest, under ep: M its received_rows)."""
    N, h, E, k = rows * routed_tokens(model, layout), model.n_embd, model.moe_experts, model.moe_top_k
    M, f = received_rows(model, layout, rows), model.expert_ffn
    groups = local_groups(model, layout)
    shared = model.moe_shared * (3 * N * f + N * h)          # always-on experts on every token, added
    return N * h + N * E + N * k + M * h + 3 * M * f + N * k * h + 2 * E * groups + 1 + shared


def moe_backward_moments(model, layout, rows, every_expert=False):
    """An MoE layer's backward as the ledger meets it: (values freed, parameters whose gradients are made) after
    each node that matters. First the balancing loss and the combine free their saved fractions, gates and
    gathered rows; then the routed experts, last first (each at M/E' rows, as balance gives): c_proj frees its
    input and makes its gradients, GELU frees its two, c_fc makes its gradients, and the last c_fc frees the
    dispatched rows (one array, the experts' inputs views of it). Where an expert's gradients outweigh what
    it frees (few tokens a rank), the layer's worst moment is the last expert's c_proj, not its start or end.
    Every expert but the last adds the same to both counts, so whatever a walk maximises along them (a weighted
    sum of the two, as a key of two) is largest at the first or the last of them: the experts between are left
    out (unless ``every_expert``), which keeps a plan of 256 experts as quick as one of 8, exactly."""
    N, h, E, k = rows * routed_tokens(model, layout), model.n_embd, model.moe_experts, model.moe_top_k
    M, f, own = received_rows(model, layout, rows), model.expert_ffn, model.moe_experts // layout.ep
    freed, made = N * k * h + N * k + 2 * E * local_groups(model, layout) + 1, 0
    moments, per_expert = [(freed, made)], M / own
    for last in [False] * (own - 1) + [True]:
        freed, made = freed + per_expert * f, made + f * h + h                          # c_proj
        moments.append((freed, made))
        freed, made = freed + 2 * per_expert * f + (M * h if last else 0), made + h * f + f   # GELU, c_fc
        moments.append((freed, made))
    return moments if every_expert or own <= 3 else moments[:3] + moments[-4:]     # the first expert, the last two


def dense_mlp_values(model, layout, rows):
    """Values the dense MLP keeps: its input, c_fc's output and GELU's two (3·N·f/t)."""
    N, t = rows * local_tokens(model, layout), layout.tp
    return N * model.n_embd / (t if layout.sequence_parallel else 1) + 3 * N * model.ffn / t


def all_to_all_bytes(model, layout, rows):
    """Bytes one of an MoE layer's all-to-alls moves between the busiest rank and the others: the rows its
    experts take (M at balance, M·moe_load on the busiest rank: dispatch brings them, combine sends them back),
    (ep-1)/ep of them from or to other ranks (four per layer and micro-batch: dispatch and combine, forward
    and backward)."""
    e = PRECISIONS[layout.precision]
    return received_rows(model, layout, rows) * model.n_embd * e * (layout.ep - 1) / layout.ep


def routed_expert_params(model, layout, pieces):
    """The routed experts' parameters a rank holds on a stage made of ``pieces``: E/ep experts per MoE block."""
    return sum(1 for x in pieces if x.name == "moe_block") * (model.moe_experts // layout.ep) * expert_params(model)


def zero_expert_extra(model, layout, pieces):
    """Bytes a rank holds beyond ZeRO over dp (x cp) for the routed experts of its stage's ``pieces``, whose
    states ZeRO shards over the dp/ep (x cp) ranks holding the same experts instead (0 without ZeRO or ep)."""
    z, dp, ep = layout.zero, layout.zero_ranks, layout.ep
    extra = {"params": 0, "grads": 0, "optimizer_state": 0, "comm_buffers": 0}
    n = routed_expert_params(model, layout, pieces) if z and ep > 1 else 0
    if not n:
        return extra
    e, wide, narrow = PRECISIONS[layout.precision], -(-n // (dp // ep)), -(-n // dp)
    extra["optimizer_state"] = optimizer_bytes(wide, layout) - optimizer_bytes(narrow, layout)
    # (grads: the 16-bit shards at stages 2 and 3, memory.py; the fp32 ones while stepping, expert_step_grads)
    extra["params"] = e * (wide - narrow) if z == 3 else 0
    extra["comm_buffers"] = e * (wide - narrow) if z == 1 else 0      # ZeRO-1's reduce-scatter lands in a shard
    return extra


def expert_step_grads(model, layout, pieces):
    """Mixed precision's fp32 gradients while a stage with routed experts steps under ZeRO and ep > 1 (None
    elsewhere): ExpertZero steps the dense shard (over dp x cp) and then the experts' (over dp/ep x cp), each
    MixedPrecisionOptimizer holding its fp32 copy only while it steps: the larger of the two."""
    n = routed_expert_params(model, layout, pieces) if layout.mixed and layout.zero and layout.ep > 1 else 0
    if not n:
        return None
    dp, local = layout.zero_ranks, sum(x.params for x in pieces)
    return fp32_step_grads(max(-(-(local - n) // dp), -(-n // (dp // layout.ep))), layout)


def paper_layer_bytes(model, layout, b, moe=False):
    """The papers' bytes per layer (Korthikanti et al. 2022, Table 2) on s/cp tokens: ring attention keeps
    no score matrix (its 5as²b term goes), Ulysses keeps a/cp heads' over the whole sequence; an MoE
    layer adds what its MLP keeps beyond the dense one's (minitrain's counting, at the precision)."""
    from .papers import korthikanti_layer_bytes
    s, h, a, t, c = model.block_size, model.n_embd, model.n_head, layout.tp, layout.cp
    sp, rc = layout.sequence_parallel, layout.recompute
    if c == 1:
        out = korthikanti_layer_bytes(s, b, h, a, t, sp, rc)
    else:
        out = korthikanti_layer_bytes(s // c, b, h, 0, t, sp, rc)
        if layout.cp_method == "ulysses" and rc == "none":
            out += 5 * a * s * s * b / (t * c)
    if moe and rc != "full":
        out += 2 * (moe_kept_values(model, layout, b) - dense_mlp_values(model, layout, b))
    return out


def experts_work(model, layout, rows):
    """(forward, backward) Work of an MoE layer's MLP on one rank (plan/work.py's counting): the router's
    product and softmax, the gathers of dispatch and combine, E/ep experts on M·ep/E rows each (balanced),
    the shared experts on every token. The all-to-alls are communication (time.py prices them)."""
    from .work import Work, _linear, _linear_backward
    N, h, E, k = rows * routed_tokens(model, layout), model.n_embd, model.moe_experts, model.moe_top_k
    M, f, local, t = received_rows(model, layout, rows), model.expert_ffn, E // layout.ep, 1   # replicated on tp
    fwd, bwd = Work(), Work()
    _linear(fwd, N, 1, h, E, False, bias=False)
    _linear_backward(bwd, N, 1, h, E, False, bias=False)
    fwd.op("softmax", N * E).op("copy", N * E).op("copy", N * k).op("copy", M * h).nodes += 4  # probs, top-k, gather
    bwd.op("softmax.backward", N * E).op("embedding.backward", M * h).op("zeros", N * h)
    fwd.elementwise("simple", N * k, 12, "int64")      # plan_dispatch: the choices sorted, counted, packed
    per = -(-M // local) if local else 0
    for n, count in ((per, local), (N, model.moe_shared)):
        if not n or not count:
            continue
        one_f, one_b = Work(), Work()                  # one expert: c_fc, GELU, c_proj
        _linear(one_f, n, 1, h, f // t, False)
        _linear(one_f, n, 1, f // t, h, False)
        _linear_backward(one_b, n, 1, h, f // t, False)
        _linear_backward(one_b, n, 1, f // t, h, False)
        one_f.op("gelu", n * f // t).nodes += 1
        one_b.op("gelu.backward", n * f // t)
        fwd.add(one_f, times=count)
        bwd.add(one_b, times=count)
    # graph nodes beyond the router's, the experts' and the four above (x reshaped, softmax, the gates' and the
    # rows' gathers): the rows split by expert and joined again (expert parallelism: the two all-to-alls, and
    # with several local experts a reorder each way); combine's join, gather, two reshapes, product and sum;
    # the aux loss's reshape, mean, two products and sum; y reshaped back; the model's loss adding the aux loss
    joins = E + 1 if layout.ep == 1 else 2 + local + (3 if local > 1 else 0)
    scaler = 1 if layout.recompute == "full" else 0    # the aux loss seeded in backward (AuxLossAutoScaler)
    sp = 2 if layout.sequence_parallel and layout.tp > 1 else 0    # P's all-reduce over tp and its division
    fwd.op("copy", M * h, count=2).op("copy", N * k * h).op("add", N * k * h, count=2).nodes += joins + 13 + scaler + sp
    bwd.op("copy", M * h, count=2).op("embedding.backward", N * k * h).op("add", N * k * h, count=2)
    return fwd, bwd

"""Experts under context parallelism: each cp rank holds s/cp positions of every row and routes the
tokens it holds, as Megatron-Core does. Routing, the experts and combine act token by token; two
things do not, and both are counted over a group's tokens on every cp rank:

- The balancing loss's f, the fraction of a group's choices that went to each expert: the ranks sum
  their counts (an all-reduce of G x E numbers) and each keeps its own mean P, so that their losses,
  averaged as their cross-entropies are, hold the group's E · sum f · P once (choice_fractions).
- A capacity (GShard): an expert takes at most C of a group's choices, first choices of all its tokens
  before second ones, each in token order (row by row, position by position). The ranks all-gather
  their choices (N·k integers), every rank plans the whole group's dispatch as one process would, and
  keeps the choices of its own tokens (plan_for_rank). Dropless needs none of it: no choice competes,
  unless the experts drop out activations: one process draws each expert's mask over all its rows, so
  each rank plans the whole group to learn where its rows sit among them (ReplicatedMoE's dropout).
Sequence parallelism inside each cp rank (the tp ranks each holding a contiguous piece of the cp rank's
positions) makes the token-sharing group cp x tp: the same counts and plan over it (token_positions).
Under expert parallelism the ep groups (blocks of ep dp ranks) of every cp coordinate hold the same
experts, so an expert's gradient is summed over dp/ep x cp ranks (GPT3D's expert data-parallel group).
"""
import numpy as np

from ...autograd import Tensor
from ...backend import array_module, to_host
from ...comm import all_reduce, ring_all_gather
from ...nn.moe_dispatch import DispatchPlan, plan_dispatch
from .zigzag import positions_of


def choice_fractions(moe, plan, tokens_per_group, dtype, comm):
    """Switch's f over a group's choices on every rank of ``comm``: the ranks' counts summed (G x E numbers),
    over the group's k·S·p choices; each rank keeps its own P, and the balancing loss its formula (nn/moe.py)."""
    xp = array_module(plan.routed)
    routed = all_reduce(comm, xp.ascontiguousarray(plan.routed, dtype=dtype), op="sum")
    return Tensor(routed / (tokens_per_group * comm.size * moe.top_k))


def token_positions(seq_len, size, rank, layout, tp=1):
    """The positions rank ``rank`` of ``size`` token-sharing ranks holds, in its order: ``size/tp`` cp ranks in
    ``layout``, each of whose positions sequence parallelism cuts into ``tp`` contiguous pieces (tp innermost,
    as the mesh's ranks are)."""
    mine = positions_of(seq_len, size // tp, rank // tp, layout)
    n = len(mine) // tp
    return mine[rank % tp * n:(rank % tp + 1) * n]


def plan_for_rank(moe, choices, shape, comm, layout, tp=1, whole_rows=False):
    """This rank's part of the dispatch one process plans for the rows' whole sequences: ``choices`` (N, k)
    of this rank's tokens, ``shape`` (rows, positions held, C), ``layout`` the sequence's over the cp ranks of
    ``comm``, each cut into ``tp`` pieces by sequence parallelism (token_positions). ``whole_rows``: also each
    expert's rows over all the ranks and where this rank's sit among them (DispatchPlan.whole_counts, whole_rows)."""
    xp, (N, k), E, p = array_module(choices), choices.shape, moe.num_experts, comm.size
    b, s = shape[0], shape[1]
    T = s * p
    gathered = ring_all_gather(comm, xp.ascontiguousarray(choices), total=N * k * p).reshape(p, b, s, k)
    places = [xp.asarray(token_positions(T, p, r, layout, tp)) for r in range(p)]   # each rank's, in its order
    whole = xp.empty((b, T, k), dtype=choices.dtype)
    for r in range(p):
        whole[:, places[r]] = gathered[r]
    plan = plan_dispatch(whole.reshape(-1, k), E, moe.capacity(b * T), moe.groups)
    # the whole plan's tokens (row · T + position) that are this rank's, as its own token indices
    mine = places[comm.rank]
    local = xp.full(b * T, -1, dtype=plan.token.dtype)
    local[(xp.arange(b)[:, None] * T + mine[None, :]).reshape(-1)] = xp.arange(N)
    token = local[plan.token]
    kept = token >= 0
    slot = (token * k + plan.slot % k)[kept]             # expert by expert, in the whole plan's order
    expert = xp.repeat(xp.arange(E), plan.counts)[kept]         # (CuPy takes the repeats as a host list)
    counts = to_host(xp.bincount(expert, minlength=E)).tolist()
    groups = xp.arange(N) // (N // moe.groups)            # this rank's tokens of each group, counted here
    routed = xp.bincount((groups[:, None] * E + choices).reshape(-1), minlength=moe.groups * E)
    mine = DispatchPlan(token=slot // k, slot=slot, counts=counts, routed=routed.reshape(moe.groups, E),
                        dropped=N * k - sum(counts), num_tokens=N, top_k=k)
    if whole_rows:   # each whole row's place among its expert's rows, this rank's kept
        starts = np.repeat(np.cumsum(plan.counts) - plan.counts, plan.counts)
        mine.whole_counts, mine.whole_rows = plan.counts, (xp.arange(len(plan.token)) - xp.asarray(starts))[kept]
    return mine

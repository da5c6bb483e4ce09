"""Token dispatch and combine for a mixture of experts, sort-based (GShard, Lepikhin et al. 2021;
Switch, Fedus et al. 2022; the permute / unpermute form of Megablocks and Megatron's dispatcher).

Each of N tokens chose k experts. plan_dispatch sorts the N·k choices by expert and decides which
are kept: an expert takes at most capacity choices from each group of tokens (GShard's groups),
first choices of all the group's tokens before second choices, each in token order. dispatch
gathers the kept choices' token rows end to end, expert by expert: plan.counts rows for each
expert, the split sizes an all-to-all sends to each expert's owner. combine undoes it: each
token's k rows come back, weighted by their gates and summed; a dropped choice contributes zero (the
residual connection carries the token). Both are gathers, so autograd needs no op of its own.
Cost: M <= N·k rows of C elements moved each way, M = sum(plan.counts).
"""
import math
from dataclasses import dataclass

from .. import backend
from ..autograd import Tensor, cat


def capacity(capacity_factor, tokens_per_group, top_k, num_experts):
    """Choices one expert takes from one group: ceil(factor · tokens_per_group · k / E) (GShard's
    expert capacity with k choices per token); None (dropless) when the factor is None."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens_per_group * top_k / num_experts)


@dataclass
class DispatchPlan:
    """Where every kept choice goes. Rows are grouped by expert, then by group, then in priority order."""
    token: object        # (M,) the token each dispatched row copies
    slot: object         # (M,) the choice it is: token · k + j (j = 0 first choice)
    counts: list         # rows per expert, on the host: the all-to-all's split sizes
    routed: object       # (G, E) choices routed to each expert from each group, before capacity
    dropped: int         # choices over capacity (token-expert pairs, not whole tokens)
    num_tokens: int
    top_k: int
    whole_counts: list = None   # a rank's part of a plan over ranks' tokens: each expert's rows over all of them,
    whole_rows: object = None   # and where this rank's rows sit among its expert's (one process's dropout masks)


def plan_dispatch(choices, num_experts, capacity=None, groups=1):
    """The plan for ``choices`` (N, k) integer expert indices (column j: each token's j-th choice).
    Tokens are cut into ``groups`` contiguous groups of N / groups; capacity is counted per group."""
    xp = backend.array_module(choices)
    N, k = choices.shape
    if N % groups:
        raise ValueError(f"moe: {N} tokens do not split into {groups} groups of equal size")
    S, E = N // groups, num_experts
    # every choice's slot (token · k + j) in priority order: group, then choice j, then token
    slots = xp.arange(N * k).reshape(groups, S, k).transpose(0, 2, 1).reshape(-1)
    expert = choices.reshape(-1)[slots]
    # expert-major; ties keep the priority order (the key is unique, so any sort gives this order)
    order = xp.argsort(expert * (N * k) + xp.arange(N * k))
    slots, expert = slots[order], expert[order]
    segment = expert * groups + slots // (S * k)              # (expert, group): non-decreasing
    per_segment = xp.bincount(segment, minlength=E * groups)
    start = xp.cumsum(per_segment) - per_segment
    kept = per_segment if capacity is None else xp.minimum(per_segment, capacity)
    counts = backend.to_host(kept.reshape(E, groups).sum(axis=1)).tolist()   # the one read: split sizes
    if capacity is not None:   # keep the first `capacity` of each segment, packed in order
        keep = xp.arange(N * k) - start[segment] < capacity
        # (not slots[keep]: a boolean mask would read its count back from the device a second time)
        packed = xp.empty(N * k + 1, dtype=slots.dtype)
        packed[xp.where(keep, xp.cumsum(keep) - 1, N * k)] = slots     # dropped ones to a spare place
        slots = packed[:sum(counts)]
    return DispatchPlan(token=slots // k, slot=slots, counts=counts,
                        routed=per_segment.reshape(E, groups).T,
                        dropped=N * k - sum(counts), num_tokens=N, top_k=k)


def dispatch(x, plan):
    """(N, C) token rows -> (M, C) rows grouped by expert (``plan.counts`` each)."""
    return x[plan.token]


def combine(y, gates, plan):
    """(M, C) expert outputs -> (N, C): for each token, the sum over its k choices of gate times the
    expert's output row; a dropped choice reads a row of zeros. ``gates`` is (N, k)."""
    xp = backend.array_module(y.data)
    N, k, M, C = plan.num_tokens, plan.top_k, y.shape[0], y.shape[1]
    row = xp.full(N * k, M)                                   # M: the zero row appended below
    row[plan.slot] = xp.arange(M)
    padded = cat([y, Tensor(xp.zeros((1, C), dtype=y.dtype))], axis=0)
    return (padded[row].reshape(N, k, C) * gates.reshape(N, k, 1)).sum(axis=1)

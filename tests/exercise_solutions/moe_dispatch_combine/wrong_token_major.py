"""Walks the choices token by token (token 0's first and second choice, then token 1's ...), so a
full expert keeps a token's second choice before another token's first one."""
import numpy as np


def dispatch(x, choices, num_experts, capacity):
    N, k = choices.shape
    expert = choices.reshape(-1)
    slot = np.arange(N * k)
    order = np.argsort(expert, kind="stable")
    expert, slot = expert[order], slot[order]
    routed = np.bincount(expert, minlength=num_experts)
    rank = np.arange(N * k) - (np.cumsum(routed) - routed)[expert]
    keep = rank < (N * k if capacity is None else capacity)
    slot = slot[keep]
    counts = np.bincount(expert[keep], minlength=num_experts).tolist()
    return x[slot // k], counts, slot


def combine(y, gates, slots):
    N, k = gates.shape
    out = np.zeros((N, y.shape[1]), y.dtype)
    np.add.at(out, slots // k, gates.reshape(-1)[slots][:, None] * y)
    return out

EXPECT = ['slots', 'first choices of every token']

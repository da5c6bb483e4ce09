"""Shards as np.array_split makes them (no padding): right numbers, but not ZeRO's layout of S = ceil(N/p) per rank."""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


def zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
    p, r, n = comm.size, comm.rank, params.size
    shard = -(-n // p)
    mine = ring_reduce_scatter(comm, grad, op="mean")
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), p)])
    if "momentum" in state:
        state["momentum"] = momentum * state["momentum"] + mine
    else:
        state["momentum"] = mine.copy()
    params[bounds[r]:bounds[r + 1]] -= lr * state["momentum"]
    params[...] = ring_all_gather(comm, params[bounds[r]:bounds[r + 1]].copy(), total=n)

EXPECT = ['padding included']

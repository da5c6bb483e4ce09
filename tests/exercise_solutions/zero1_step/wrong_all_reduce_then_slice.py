"""Averages the whole gradient with an all-reduce and then keeps its shard: exact, but 3(p-1)·S elements sent instead of 2(p-1)·S."""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


def zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
    p, r, n = comm.size, comm.rank, params.size
    shard = -(-n // p)
    padded = np.zeros(shard * p)
    padded[:n] = grad
    from minitrain.comm import ring_all_reduce
    mine = ring_all_reduce(comm, padded, op="mean")[r * shard:(r + 1) * shard].copy()
    if "momentum" in state:
        state["momentum"] = momentum * state["momentum"] + mine
    else:
        state["momentum"] = mine.copy()
    full = np.zeros(shard * p)
    full[:n] = params
    full[r * shard:(r + 1) * shard] -= lr * state["momentum"]
    params[...] = ring_all_gather(comm, full[r * shard:(r + 1) * shard].copy(), total=shard * p)[:n]

EXPECT = ['bytes per step', 'not needed']

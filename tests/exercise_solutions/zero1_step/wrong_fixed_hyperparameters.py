"""The step uses the default learning rate and momentum whatever lr and momentum it was given."""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


def zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
    p, r, n = comm.size, comm.rank, params.size
    shard = -(-n // p)
    padded = np.zeros(shard * p)
    padded[:n] = grad
    mine = ring_reduce_scatter(comm, padded, op="mean")
    if "momentum" in state:
        state["momentum"] = 0.9 * state["momentum"] + mine
    else:
        state["momentum"] = mine.copy()
    full = np.zeros(shard * p)
    full[:n] = params
    full[r * shard:(r + 1) * shard] -= 0.1 * state["momentum"]
    params[...] = ring_all_gather(comm, full[r * shard:(r + 1) * shard].copy(), total=shard * p)[:n]

EXPECT = ['lr=0.05, momentum=0.8', 'one process']

"""All-reduces the whole gradient and keeps momentum for every parameter: DDP, not ZeRO-1."""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


def zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
    p, r, n = comm.size, comm.rank, params.size
    shard = -(-n // p)
    from minitrain.comm import ring_all_reduce
    g = ring_all_reduce(comm, grad, op="mean")
    state["momentum"] = momentum * state["momentum"] + g if "momentum" in state else g.copy()
    params -= lr * state["momentum"]

EXPECT = ['momentum', "only this rank's"]

"""Gathers and scatters along axis 0 (the batch) instead of axis 1 (the sequence)."""
import numpy as np

from minitrain.autograd import Function
from minitrain.comm import ring_all_gather, ring_reduce_scatter


def gather(comm, x):
    front = np.ascontiguousarray(np.moveaxis(x, 0, 0))
    full = ring_all_gather(comm, front.reshape(-1), total=front.size * comm.size)
    full = full.reshape((front.shape[0] * comm.size,) + front.shape[1:])
    return np.ascontiguousarray(np.moveaxis(full, 0, 0))


def reduce_scatter(comm, x):
    front = np.ascontiguousarray(np.moveaxis(x, 0, 0))
    mine = ring_reduce_scatter(comm, front.reshape(-1))
    mine = mine.reshape((front.shape[0] // comm.size,) + front.shape[1:])
    return np.ascontiguousarray(np.moveaxis(mine, 0, 0))


class GatherFromSequenceParallelRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return gather(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(ctx.comm, grad), None


class ReduceScatterToSequenceParallelRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return reduce_scatter(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return gather(ctx.comm, grad), None

EXPECT = ['gather along axis 1']

"""The all-gather's backward keeps this rank's slice of the gradient instead of reduce-scattering it."""
import numpy as np

from minitrain.autograd import Function
from minitrain.comm import ring_all_gather, ring_reduce_scatter


def gather(comm, x):
    front = np.ascontiguousarray(np.moveaxis(x, 1, 0))
    full = ring_all_gather(comm, front.reshape(-1), total=front.size * comm.size)
    full = full.reshape((front.shape[0] * comm.size,) + front.shape[1:])
    return np.ascontiguousarray(np.moveaxis(full, 0, 1))


def reduce_scatter(comm, x):
    front = np.ascontiguousarray(np.moveaxis(x, 1, 0))
    mine = ring_reduce_scatter(comm, front.reshape(-1))
    mine = mine.reshape((front.shape[0] // comm.size,) + front.shape[1:])
    return np.ascontiguousarray(np.moveaxis(mine, 0, 1))


class GatherFromSequenceParallelRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return gather(comm, x)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[1] // ctx.comm.size
        return np.ascontiguousarray(grad[:, ctx.comm.rank * n:(ctx.comm.rank + 1) * n]), None


class ReduceScatterToSequenceParallelRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return reduce_scatter(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return gather(ctx.comm, grad), None

EXPECT = ['dL/dx', 'partial gradient']

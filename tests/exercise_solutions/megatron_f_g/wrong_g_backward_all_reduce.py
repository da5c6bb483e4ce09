"""g all-reduces in backward too: every rank's gradient is already whole, so it is counted t times."""
from minitrain.autograd import Function
from minitrain.comm import ring_all_reduce


class CopyToTensorParallelRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return ring_all_reduce(ctx.comm, grad), None


class ReduceFromTensorParallelRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return ring_all_reduce(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return ring_all_reduce(ctx.comm, grad), None

EXPECT = ['dL/dX', '= p']

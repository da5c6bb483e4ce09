"""g adds the partial sums by gathering every rank's copy and summing: exact, but (t-1)·N bytes instead of an all-reduce's 2(t-1)/t·N."""
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
        from minitrain.comm import ring_all_gather
        every = ring_all_gather(comm, x.reshape(-1), total=x.size * comm.size)
        return every.reshape((comm.size,) + x.shape).sum(axis=0)

    @staticmethod
    def backward(ctx, grad):
        return grad, None

EXPECT = ['bytes', 'one all-reduce each way']

"""Megatron's conjugate communication operators (Shoeybi et al. 2019, sec. 3, Figure 3) and their
sequence-parallel forms (Korthikanti et al. 2022, sec. 4.2.2), as autograd Functions.

f: identity forward, all-reduce of the gradient backward (before a column-parallel layer);
g: all-reduce forward, identity backward (after a row-parallel layer). With sequence parallelism f
becomes an all-gather along the sequence (backward: reduce-scatter) and g a reduce-scatter
(backward: all-gather): the same bytes, 2(t-1)/t of the activation per rank, as the all-reduce
they replace, since an all-reduce is a reduce-scatter plus an all-gather.
"""
from ...autograd import Function
from ...backend import array_module
from ...comm import ring_all_gather, ring_all_reduce, ring_reduce_scatter


# ---------------------------------------------------------------- the conjugate operators
class CopyToTensorParallelRegion(Function):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, g):
        return ring_all_reduce(ctx.comm, g), None


class ReduceFromTensorParallelRegion(Function):
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return ring_all_reduce(comm, x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def gather_along(comm, x, axis):
    """Concatenate every rank's x along axis (equal shards): one ring all-gather."""
    xp = array_module(x)
    front = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
    full = ring_all_gather(comm, front.reshape(-1), total=front.size * comm.size)
    full = full.reshape((front.shape[0] * comm.size,) + front.shape[1:])
    return xp.ascontiguousarray(xp.moveaxis(full, 0, axis))


def reduce_scatter_along(comm, x, axis):
    """Sum over the ranks, each rank keeping its 1/t slice along axis: one ring reduce-scatter."""
    xp = array_module(x)
    if x.shape[axis] % comm.size:
        raise ValueError(f"[rank {comm.rank}] sequence parallelism: length {x.shape[axis]} along axis {axis} "
                         f"is not divisible by the {comm.size} tensor-parallel ranks")
    front = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
    mine = ring_reduce_scatter(comm, front.reshape(-1))
    mine = mine.reshape((front.shape[0] // comm.size,) + front.shape[1:])
    return xp.ascontiguousarray(xp.moveaxis(mine, 0, axis))


class GatherFromSequenceParallelRegion(Function):
    """Sequence parallelism's f: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, comm, axis=1):
        ctx.comm, ctx.axis = comm, axis
        return gather_along(comm, x, axis)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_along(ctx.comm, g, ctx.axis), None


class ReduceScatterToSequenceParallelRegion(Function):
    """Sequence parallelism's g: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, axis=1):
        ctx.comm, ctx.axis = comm, axis
        return reduce_scatter_along(comm, x, axis)

    @staticmethod
    def backward(ctx, g):
        return gather_along(ctx.comm, g, ctx.axis), None


class GatherFromTensorParallelRegion(Function):
    """All-gather along the last axis forward, keep this rank's slice backward (the LM head's
    vocabulary-split logits, gathered whole for sampling)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.width = comm, x.shape[-1]
        return gather_along(comm, x, x.ndim - 1)

    @staticmethod
    def backward(ctx, g):
        r, w = ctx.comm.rank, ctx.width
        return array_module(g).ascontiguousarray(g[..., r * w:(r + 1) * w]), None


def f(x, comm, sequence_parallel=False):
    """Before a column-parallel layer: Megatron's f, or with sequence parallelism its all-gather."""
    return GatherFromSequenceParallelRegion.apply(x, comm) if sequence_parallel \
        else CopyToTensorParallelRegion.apply(x, comm)


def g(x, comm, sequence_parallel=False):
    """After a row-parallel layer: Megatron's g, or with sequence parallelism its reduce-scatter."""
    return ReduceScatterToSequenceParallelRegion.apply(x, comm) if sequence_parallel \
        else ReduceFromTensorParallelRegion.apply(x, comm)

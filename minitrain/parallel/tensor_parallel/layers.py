"""Tensor-parallel layers (Shoeybi et al. 2019, sec. 3): Y = X A with A split by columns, Y = X B
with B split by rows, an embedding and a cross-entropy split by vocabulary, and a dropout that
draws the whole tensor's mask and keeps this rank's slice (so the sharded model is the same
function as one process's).

Per rank and layer: weights 1/t of the matrix; the column-parallel layer sends nothing in forward
(f all-reduces the input gradient in backward), the row-parallel layer one all-reduce of its output
(g); the vocab-parallel cross-entropy all-reduces three (B, T) tensors, never the (B, T, V) logits.
"""
import math

import numpy as np

from ... import random
from ...autograd import Function, ops
from ...backend import array_module
from ...comm import ring_all_reduce
from ...nn import Module, Parameter
from ...nn import functional as F
from .comms import f, g, gather_along, reduce_scatter_along


class ParallelDropout(Module):
    """nn.Dropout for an activation split across comm along axis (rank r holding the r-th of t
    equal blocks), or replicated on every rank (axis=None: plain dropout, the same mask on all)."""

    def __init__(self, p, comm, axis=None):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.comm, self.axis = p, comm, axis

    def forward(self, x):
        if not self.training or self.p == 0.0 or self.axis is None or self.comm.size == 1:
            return F.dropout(x, self.p, self.training)
        full_shape = list(x.shape)
        full_shape[self.axis] *= self.comm.size
        n = x.shape[self.axis]
        index = [slice(None)] * x.ndim
        index[self.axis] = slice(self.comm.rank * n, (self.comm.rank + 1) * n)
        return ops.Dropout.apply(x, self.p, full_shape=tuple(full_shape), index=tuple(index))


def positions(T, comm, sequence_parallel, xp):
    """The positions of this rank's tokens: all T, or with sequence parallelism its T/t slice."""
    if not sequence_parallel:
        return xp.arange(T)
    local = divide(T, comm.size, "the sequence length (sequence parallelism)")
    return xp.arange(comm.rank * local, (comm.rank + 1) * local)


def divide(n, t, what):
    """n / t, or a clear error naming what does not split evenly over the tp ranks."""
    if n % t:
        raise ValueError(f"tensor parallelism: {what} = {n} is not divisible by tp = {t}")
    return n // t


# ---------------------------------------------------------------- layers
class AllGatherLinear(Function):
    """Sequence parallelism's f fused with the column-parallel matmul: all-gather the sequence
    shards, multiply, and keep only the shard for backward; backward all-gathers it again
    (Korthikanti et al. 2022 sec. 4.2.2: one extra all-gather instead of t times the memory)
    and reduce-scatters the input gradient. Each half only when asked (needs_input_grad): a
    zero-bubble pipeline's B asks for the input's gradient alone (the reduce-scatter) and its W for
    the weights' (the re-gather), so the split backward sends what the whole one does."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        full = gather_along(comm, x, 1)
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        out = ops.matmul_rows(full, weight.T)
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        gw = gb = gx = None
        g2 = g.reshape(-1, g.shape[-1])
        if need[1]:
            full = gather_along(ctx.comm, x, 1)              # the re-gather
            gw = g2.T @ full.reshape(-1, full.shape[-1])
        if ctx.has_bias and need[2]:
            gb = g2.sum(axis=0)
        if need[0]:
            gx = reduce_scatter_along(ctx.comm, ops.matmul_rows(g, weight), 1)
        return gx, gw, gb, None


class ColumnParallelLinear(Module):
    """Y = X A with A (in, out) split by columns: rank r holds weight rows [r·out/t, (r+1)·out/t)
    (weights are (out, in), as nn.Linear). Input replicated (f before it; with sequence parallelism
    a sequence shard, gathered by AllGatherLinear), output split along the last axis."""

    def __init__(self, in_features, out_features, comm, bias=True, sequence_parallel=False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = divide(out_features, comm.size, "out_features")
        bound = 1.0 / math.sqrt(in_features)
        self.weight = Parameter(random.uniform(-bound, bound, (local, in_features)))
        self.bias = Parameter(random.uniform(-bound, bound, (local,))) if bias else None

    def forward(self, x):
        if self.sequence_parallel:            # x is a sequence shard: gather, multiply, save the shard only
            return AllGatherLinear.apply(x, self.weight, self.bias, self.comm)
        return F.linear(f(x, self.comm), self.weight, self.bias)


class RowParallelLinear(Module):
    """Y = X B with B (in, out) split by rows: rank r holds weight columns [r·in/t, (r+1)·in/t).
    Input split along its last axis (as a ColumnParallelLinear leaves it), partial products summed
    by g, then the (replicated) bias added once."""

    def __init__(self, in_features, out_features, comm, bias=True, sequence_parallel=False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = divide(in_features, comm.size, "in_features")
        bound = 1.0 / math.sqrt(in_features)
        self.weight = Parameter(random.uniform(-bound, bound, (out_features, local)))
        self.bias = Parameter(random.uniform(-bound, bound, (out_features,))) if bias else None

    def forward(self, x):
        y = g(F.linear(x, self.weight), self.comm, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(Module):
    """Rank r holds rows [r·V/t, (r+1)·V/t); tokens outside give zero rows; g sums the ranks."""

    def __init__(self, num_embeddings, embedding_dim, comm, sequence_parallel=False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings = num_embeddings
        local = divide(num_embeddings, comm.size, "the (padded) vocabulary")
        self.start = comm.rank * local
        self.weight = Parameter(random.randn(local, embedding_dim))

    def forward(self, idx):
        xp = array_module(idx)
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(xp.where(outside, 0, local), self.weight)
        rows = rows.masked_fill(outside[..., None], 0.0)
        return g(rows, self.comm, self.sequence_parallel)


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from logits split by vocabulary (B, T, V/t), without gathering them:
    loss = log Σ_v exp(z_v - M) + M - z_target, with M, the sum and z_target each all-reduced."""

    @staticmethod
    def forward(ctx, logits, targets, comm, start, vocab_size):
        xp = array_module(logits)
        local_v = logits.shape[-1]
        z = logits.reshape(-1, local_v).astype(logits.dtype, copy=True)
        z[:, max(0, vocab_size - start):] = -np.inf            # the padding is not a token
        t = targets.reshape(-1)
        local_max = z.max(axis=1)
        m = ring_all_reduce(comm, xp.ascontiguousarray(local_max), op="max")
        e = xp.exp(z - m[:, None])
        total = ring_all_reduce(comm, e.sum(axis=1))
        mine = (t >= start) & (t < start + local_v)
        rows = xp.arange(t.shape[0])
        target_logit = xp.where(mine, z[rows, xp.where(mine, t - start, 0)], 0.0).astype(z.dtype, copy=False)
        target_logit = ring_all_reduce(comm, xp.ascontiguousarray(target_logit))
        loss = xp.log(total) + m - target_logit
        ctx.save_for_backward(e / total[:, None], t)
        ctx.start, ctx.shape, ctx.mine = start, logits.shape, mine
        return xp.asarray(loss.mean(), dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, t = ctx.saved_tensors
        xp = array_module(softmax)
        n = t.shape[0]
        d = softmax.copy()
        # -1 at each target this rank holds (0 elsewhere: no boolean mask, which would synchronise on a GPU)
        d[xp.arange(n), xp.where(ctx.mine, t - ctx.start, 0)] -= ctx.mine.astype(d.dtype)
        d *= grad / n
        return d.reshape(ctx.shape), None



"""Shape and indexing: reshape, permute, indexing, concatenation, masked fill, embedding lookup. Their
backwards move gradients back to where the elements came from (and add where an index repeats).
"""
import numpy as np

from ...backend import array_module, scatter_add
from ..function import Function
from .arithmetic import unbroadcast


class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape)


class Permute(Function):
    @staticmethod
    def forward(ctx, a, axes):
        ctx.axes = axes
        return a.transpose(axes)

    @staticmethod
    def backward(ctx, g):
        inverse = [0] * len(ctx.axes)
        for i, ax in enumerate(ctx.axes):
            inverse[ax] = i
        return g.transpose(inverse)


def _is_basic_index(idx):
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in items)


class GetItem(Function):
    @staticmethod
    def forward(ctx, a, idx):
        ctx.shape, ctx.dtype, ctx.idx = a.shape, a.dtype, idx
        return a[idx]

    @staticmethod
    def backward(ctx, g):
        xp = array_module(g)
        out = xp.zeros(ctx.shape, dtype=ctx.dtype)
        if _is_basic_index(ctx.idx):
            out[ctx.idx] = g           # basic slices never repeat an element
        else:
            scatter_add(out, ctx.idx, g)  # fancy indices may: accumulate
        return out


class Cat(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        ctx.axis = axis
        ctx.sizes = [a.shape[axis] for a in arrays]
        return array_module(arrays[0]).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        bounds = np.cumsum(ctx.sizes)[:-1].tolist()
        return tuple(array_module(g).split(g, bounds, axis=ctx.axis))


class MaskedFill(Function):
    """out = value where mask else a (mask is a boolean array, broadcast against a; a mask of more
    dimensions than a broadcasts a too, and the gradient is summed back, as PyTorch's)."""

    @staticmethod
    def forward(ctx, a, mask, value):
        ctx.mask, ctx.shape = mask, a.shape
        return array_module(a).where(mask, value, a)

    @staticmethod
    def backward(ctx, g):
        return unbroadcast(array_module(g).where(ctx.mask, 0, g), ctx.shape), None, None


class Embedding(Function):
    """weight[indices]; the backward scatters rows back, adding where an index repeats."""

    @staticmethod
    def forward(ctx, indices, weight):
        ctx.save_for_backward(indices)
        ctx.wshape = weight.shape
        return weight[indices]

    @staticmethod
    def backward(ctx, g):
        (indices,) = ctx.saved_tensors
        gw = array_module(g).zeros(ctx.wshape, dtype=g.dtype)
        scatter_add(gw, indices.reshape(-1), g.reshape(-1, ctx.wshape[-1]))
        return None, gw

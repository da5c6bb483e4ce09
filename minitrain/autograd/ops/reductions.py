"""Reductions over axes (sum, mean, max): the backward gives the reduced axes back and broadcasts the
gradient over them (max: only to the maxima).
"""
import numpy as np

from ...backend import array_module
from ..function import Function


def _norm_axis(axis, ndim):
    """The reduced axes, each in [0, ndim); as PyTorch, a 0-d tensor takes axis 0 or -1 (nothing to reduce)
    and an axis out of range is refused by name."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    low, high = -max(ndim, 1), max(ndim, 1) - 1
    for a in axes:
        if not low <= a <= high:
            raise IndexError(f"axis {a} is out of range for a tensor of {ndim} dimension(s) "
                             f"(expected in [{low}, {high}])")
    return tuple(int(a) % ndim for a in axes) if ndim else ()


def _numpy_axis(axis, a):
    """The axis NumPy reduces over: None for a 0-d array (which NumPy gives no axis 0)."""
    return axis if a.ndim else None


def _expand(g, shape, axes, keepdims):
    """Give a reduced gradient back its reduced axes (as size 1), ready to broadcast."""
    if not keepdims:
        g = g.reshape([1 if i in axes else n for i, n in enumerate(shape)])
    return g


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape = a.shape
        ctx.axes = _norm_axis(axis, a.ndim)
        ctx.keepdims = keepdims
        return array_module(a).asarray(a.sum(axis=_numpy_axis(axis, a), keepdims=keepdims))

    @staticmethod
    def backward(ctx, g):
        g = _expand(g, ctx.shape, ctx.axes, ctx.keepdims)
        return array_module(g).broadcast_to(g, ctx.shape)


class Mean(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape = a.shape
        ctx.axes = _norm_axis(axis, a.ndim)
        ctx.keepdims = keepdims
        return array_module(a).asarray(a.mean(axis=_numpy_axis(axis, a), keepdims=keepdims))

    @staticmethod
    def backward(ctx, g):
        count = 1
        for ax in ctx.axes:
            count *= ctx.shape[ax]
        # an empty reduced axis: the mean is NaN and its gradient empty (as PyTorch), not 1/0
        g = _expand(g, ctx.shape, ctx.axes, ctx.keepdims) * (1.0 / count if count else 0.0)
        return array_module(g).broadcast_to(g, ctx.shape)


class Max(Function):
    """Maximum over axes. The gradient is shared equally between tied maxima (as torch.amax)."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.axes = _norm_axis(axis, a.ndim)
        ctx.keepdims = keepdims
        out = a.max(axis=_numpy_axis(axis, a), keepdims=True)
        ctx.save_for_backward(a, out)
        return array_module(a).asarray(out if keepdims else out.reshape(
            [n for i, n in enumerate(a.shape) if i not in ctx.axes]))

    @staticmethod
    def backward(ctx, g):
        a, out = ctx.saved_tensors
        mask = a == out
        count = mask.sum(axis=ctx.axes, keepdims=True)
        return _expand(g, a.shape, ctx.axes, ctx.keepdims) * mask / count

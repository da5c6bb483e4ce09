"""Softmax, log-softmax and the cross-entropy loss (softmax and negative log-likelihood fused): on the
host in NumPy, on the GPU in fused kernels (kernels.py). Softmax takes a float16 / bfloat16 input in
float32 (Megatron's attention_softmax_in_fp32, PyTorch autocast's softmax): its exponentials' sum would
round in 16 bits; its output and saved probabilities are of the input's dtype.
"""
import math

import numpy as np

from ... import kernels
from ...backend import array_module, is_device_array, scatter_add, to_host
from ..function import Function
from .layer_norm import widen


class Softmax(Function):
    """softmax(x) along ``axis``; attention's form softmax(where(mask, -inf, x·scale)) in one op, so
    that the GPU scales and masks in one fused pass and backward (which is 0 where masked) in one.
    A row the mask covers whole gets weights 0 and gradient 0, as in PyTorch's
    scaled_dot_product_attention (softmax alone gives NaN there, as torch.softmax does)."""

    @staticmethod
    def forward(ctx, x, axis=-1, scale=None, mask=None):
        ctx.axis, ctx.scale = axis, scale
        dtype, x = x.dtype, widen(x)
        out = _softmax(x, axis, scale, mask).astype(dtype, copy=False)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        dtype, g, out = g.dtype, widen(g), widen(out)
        if is_device_array(g):
            gx = kernels.softmax_backward(out, g, ctx.axis, 1.0 if ctx.scale is None else ctx.scale)
        else:
            gx = out * (g - (g * out).sum(axis=ctx.axis, keepdims=True))   # 0 where masked (out is 0 there)
            gx = gx if ctx.scale is None else gx * ctx.scale
        return gx.astype(dtype, copy=False)


def _softmax(x, axis, scale, mask):
    """softmax(where(mask, -inf, x·scale)) along ``axis``, in x's dtype."""
    if is_device_array(x):
        if scale is not None or mask is not None:
            x = kernels.scale_and_mask(x, 1.0 if scale is None else scale, mask)
        out = kernels.softmax(x, axis, masked=mask is not None)
    else:
        xp = array_module(x)
        if scale is not None:
            x = x * scale
        if mask is not None:
            x = xp.where(mask, -math.inf, x)
        m = x.max(axis=axis, keepdims=True)
        if mask is not None:
            m[m == -math.inf] = 0            # a row masked whole: its exps are 0, its sum made 1 below
        e = xp.exp(x - m)
        s = e.sum(axis=axis, keepdims=True)
        if mask is not None:
            s[s == 0] = 1
        out = e / s
    return out


def _log_softmax(x, axis):
    if is_device_array(x):
        return kernels.log_softmax(x, axis)
    xp = array_module(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, x, axis=-1):
        out = _log_softmax(x, axis)
        ctx.axis = axis
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        if is_device_array(g):
            return kernels.log_softmax_backward(out, g, ctx.axis)
        return g - array_module(out).exp(out) * g.sum(axis=ctx.axis, keepdims=True)


def check_targets(t, classes, call="cross_entropy", what="targets"):
    """IndexError unless every target (or index) lies in [0, classes). On device arrays this reads their
    range back (one counted copy, a synchronisation): the device path does it only when asked
    (cross_entropy's validate_targets=True)."""
    if not t.size:
        return
    if is_device_array(t):
        lo, hi = (int(v) for v in to_host(array_module(t).stack([t.min(), t.max()])))
    else:
        lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= classes:
        raise IndexError(f"{call}: {what} must lie in [0, {classes}), found {lo}..{hi}")


_rows = {}     # (n, module, GPU) -> arange(n) on that GPU: the targets' row indices, made once per size


class CrossEntropy(Function):
    """Mean negative log-likelihood of integer targets under softmax(logits), fused.
    logits (..., C), targets (...) of integers; gradient (softmax - onehot) / N.
    Bad targets: on the host an IndexError; on the GPU, where checking them would make the host wait
    for the device in every step, an out-of-range target makes the loss NaN (no synchronisation),
    and validate_targets=True checks them with an IndexError (one synchronisation)."""

    @staticmethod
    def forward(ctx, logits, targets, validate_targets=False):
        xp = array_module(logits)
        classes = logits.shape[-1]
        t = targets.reshape(-1)
        n = t.shape[0]
        ctx.shape = logits.shape
        if xp is not np:
            if validate_targets:
                check_targets(t, classes)
            logp = kernels.log_softmax(logits.reshape(-1, classes), 1)
            clipped = xp.clip(t, 0, classes - 1)
            key = (n, id(xp), logp.device.id)
            if key not in _rows:
                _rows[key] = xp.arange(n)
            ctx.save_for_backward(logp, clipped)
            return kernels.nll(logp[_rows[key], clipped], t, classes).astype(logits.dtype, copy=False)
        logp = _log_softmax(logits.reshape(-1, classes), axis=1)
        check_targets(t, classes)
        rows = xp.arange(n)
        ctx.save_for_backward(logp, t)
        return xp.asarray(-logp[rows, t].sum() / n, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, g):
        logp, t = ctx.saved_tensors
        xp = array_module(logp)
        n = t.shape[0]
        if xp is not np:                          # exp(logp)·g/n, then -g/n at the targets: 4 kernels
            scale = g * (1.0 / max(n, 1))
            grad = kernels.softmax_of_logp(logp, scale)
            scatter_add(grad, (_rows[(n, id(xp), logp.device.id)], t), -scale)
            return grad.reshape(ctx.shape), None
        grad = xp.exp(logp)
        grad[xp.arange(n), t] -= 1.0
        grad *= g / n
        return grad.reshape(ctx.shape), None

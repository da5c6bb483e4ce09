"""Activations and dropout, elementwise: ReLU, GELU (Hendrycks & Gimpel 2016, GPT-2's tanh form) and
inverted dropout, whose mask comes from minitrain.random so that recomputation replays it.
"""
import math

from ... import kernels
from ...backend import array_module, is_device_array
from ... import random as _random
from ..function import Function


class ReLU(Function):
    @staticmethod
    def forward(ctx, a):
        out = array_module(a).maximum(a, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * (out > 0)


_GELU_C = math.sqrt(2.0 / math.pi)


class GELU(Function):
    """GELU, tanh approximation (Hendrycks & Gimpel 2016; GPT-2's): 0.5 x (1 + tanh(c (x + 0.044715 x^3)))."""

    @staticmethod
    def forward(ctx, x):
        if is_device_array(x):                      # one fused kernel (kernels.py)
            out, t = kernels.gelu(x)
            ctx.save_for_backward(x, t)
            return out
        # ml_dtypes' bfloat16 tanh returns float32: t is kept in x's dtype (what the memory plan counts)
        t = array_module(x).tanh(_GELU_C * (x + 0.044715 * x * x * x)).astype(x.dtype, copy=False)
        ctx.save_for_backward(x, t)
        return 0.5 * x * (1.0 + t)

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        if is_device_array(g):
            return kernels.gelu_backward(g, x, t)
        dinner = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


class Dropout(Function):
    """Zero each element with probability p and scale the rest by 1/(1-p) (inverted dropout).
    The mask comes from minitrain.random, so recomputation can replay it by restoring the state.
    With ``full_shape`` and ``index``, x is the slice ``index`` of a tensor of ``full_shape`` split
    across ranks (tensor, sequence or context parallelism): the slice of the whole tensor's mask, as one
    process draws it, so the ranks' masks put together are one process's mask (on the host only the
    slice's numbers are drawn, random.rand_at; on the GPU the whole is drawn and sliced)."""

    @staticmethod
    def forward(ctx, x, p, full_shape=None, index=None):
        if is_device_array(x):          # drawn on the device from one host seed; a bool mask is kept
            draw = _random.device_uniform(*(x.shape if full_shape is None else full_shape), dtype=x.dtype)
            ctx.scale = 1.0 / (1.0 - p)
            out, keep = kernels.dropout(x, draw if index is None else draw[index], p, ctx.scale)
            ctx.save_for_backward(keep)
            return out
        draw = _random.rand(*x.shape, dtype=x.dtype) if index is None else _random.rand_at(full_shape, index, x.dtype)
        keep = draw >= p
        mask = keep * (1.0 / (1.0 - p))
        mask = mask.astype(x.dtype, copy=False)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        if is_device_array(g):
            return kernels.dropout_backward(g, mask, ctx.scale), None
        return g * mask, None

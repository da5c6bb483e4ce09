"""Layer normalisation (Ba et al. 2016), fused: one graph node for the normalisation, the scale and the
shift, and its backward in closed form. A float16 / bfloat16 input is normalised in float32 (Megatron's
fused LayerNorm, PyTorch autocast's layer_norm): its mean and variance would lose the result in 16 bits
(a square overflows fp16 past 256); the output and the saved x̂ are of the input's dtype, 1/σ float32.
"""
import numpy as np

from ... import kernels
from ...backend import LOW_PRECISION, array_module, is_device_array
from ..function import Function


def widen(a):
    """``a`` in float32 where it is float16 / bfloat16 (None stays None): what mixed precision computes
    normalisations and softmaxes in."""
    return a.astype(np.float32) if a is not None and a.dtype in LOW_PRECISION else a


class LayerNorm(Function):
    """Layer normalisation over the last ``ndims`` axes (Ba et al. 2016), fused:
    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance."""

    @staticmethod
    def forward(ctx, x, weight, bias, ndims=1, eps=1e-5):
        axes = tuple(range(x.ndim - ndims, x.ndim))
        ctx.axes = axes
        dtype = x.dtype
        out, xhat, rstd = _normalize(widen(x), widen(weight), widen(bias), axes, eps)
        ctx.save_for_backward(xhat.astype(dtype, copy=False), rstd, weight)
        return out.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, weight = ctx.saved_tensors
        gx, gw, gb = _normalize_backward(ctx, widen(g), widen(xhat), rstd, widen(weight))
        if g.dtype in LOW_PRECISION:             # computed in float32: back to the inputs' dtypes
            gx = None if gx is None else gx.astype(xhat.dtype)
            gw, gb = (None if d is None else d.astype(xhat.dtype if weight is None else weight.dtype) for d in (gw, gb))
        return gx, gw, gb


def _normalize(x, weight, bias, axes, eps):
    """(y, x̂, 1/σ) in x's dtype."""
    if is_device_array(x):                       # 4 kernels (kernels.py)
        return kernels.layer_norm(x, weight, bias, axes, eps)
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=axes, keepdims=True)
    rstd = 1.0 / array_module(x).sqrt(var + eps)
    xhat = centered * rstd
    out = xhat * weight if weight is not None else xhat.copy()
    if bias is not None:
        out += bias
    return out, xhat, rstd


def _normalize_backward(ctx, g, xhat, rstd, weight):
    """(dx, dweight, dbias), each None where its input needs no gradient."""
    axes = ctx.axes
    lead = tuple(range(xhat.ndim - len(axes)))
    need = ctx.needs_input_grad
    if is_device_array(g):
        gw = kernels.sum_product(lead)(g, xhat) if weight is not None and need[1] else None
        gb = kernels.sum_leading(g, len(lead)) if len(need) > 2 and need[2] else None
        gx = kernels.layer_norm_backward(g, xhat, rstd, weight, axes) if need[0] else None
        return gx, gw, gb
    gw = (g * xhat).sum(axis=lead) if weight is not None and need[1] else None
    gb = g.sum(axis=lead) if len(need) > 2 and need[2] else None
    gx = None
    if need[0]:
        dxhat = g * weight if weight is not None else g
        gx = rstd * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                     - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))
    return gx, gw, gb

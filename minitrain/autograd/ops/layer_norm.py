"""Layer normalisation (Ba et al. 2016), fused: one graph node for the normalisation, the scale and the
shift, and its backward in closed form.
"""
from ... import kernels
from ...backend import array_module, is_device_array
from ..function import Function


class LayerNorm(Function):
    """Layer normalisation over the last ``ndims`` axes (Ba et al. 2016), fused:
    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance."""

    @staticmethod
    def forward(ctx, x, weight, bias, ndims=1, eps=1e-5):
        axes = tuple(range(x.ndim - ndims, x.ndim))
        ctx.axes = axes
        if is_device_array(x):                       # 4 kernels (kernels.py)
            out, xhat, rstd = kernels.layer_norm(x, weight, bias, axes, eps)
            ctx.save_for_backward(xhat, rstd, weight)
            return out
        mean = x.mean(axis=axes, keepdims=True)
        centered = x - mean
        var = (centered * centered).mean(axis=axes, keepdims=True)
        rstd = 1.0 / array_module(x).sqrt(var + eps)
        xhat = centered * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        out = xhat * weight if weight is not None else xhat.copy()
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, weight = ctx.saved_tensors
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

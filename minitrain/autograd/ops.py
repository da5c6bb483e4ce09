"""The differentiable operations: each forward next to its backward.

Forwards receive and return raw xp arrays; backwards return one gradient per positional
input (None where no gradient is needed). Broadcasting is undone by the one helper
unbroadcast. Dtypes never widen: constants are Python floats, which NumPy 2 treats as
"weak" (a float32 array times 0.5 stays float32), never NumPy float64 scalars.
"""
import math

import numpy as np

from .. import kernels
from ..backend import array_module, is_device_array, scatter_add, to_host
from .. import random as _random
from .function import Function


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added or stretched, so that it has ``shape``."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    if extra:
        grad = kernels.sum_leading(grad, extra)
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad


def _shape(x):
    return getattr(x, "shape", ())


# ---------------------------------------------------------------- elementwise arithmetic
class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a + b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        need = ctx.needs_input_grad
        return (unbroadcast(g, sa) if need[0] else None,
                unbroadcast(g, sb) if need[1] else None)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        need = ctx.needs_input_grad
        return (unbroadcast(g, sa) if need[0] else None,
                unbroadcast(-g, sb) if need[1] else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        return (unbroadcast(g * b, _shape(a)) if need[0] else None,
                unbroadcast(g * a, _shape(b)) if need[1] else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        ga = unbroadcast(g / b, _shape(a)) if need[0] else None
        gb = unbroadcast(-g * a / (b * b), _shape(b)) if need[1] else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    """a ** b, for a tensor base and a number or tensor exponent."""

    @staticmethod
    def forward(ctx, a, b):
        out = a ** b
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved_tensors
        need = ctx.needs_input_grad
        ga = gb = None
        if need[0]:
            ga = unbroadcast(g * b * a ** (b - 1), _shape(a))
        if need[1]:
            xp = array_module(out)
            gb = unbroadcast(g * out * xp.log(a), _shape(b))
        return ga, gb


class Cast(Function):
    """``x.to(dtype)``: a copy in another dtype; the gradient goes back in the input's dtype
    (mixed precision casts weights down and logits up through this)."""

    keeps_low_precision = False

    @staticmethod
    def forward(ctx, a, dtype):
        ctx.dtype = a.dtype
        return a.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        with np.errstate(over="ignore"):      # fp16 overflow becomes inf: the loss scaler's signal
            return g.astype(ctx.dtype), None


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = array_module(a).exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return array_module(a).log(a)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g / a


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = array_module(a).tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * (1.0 - out * out)


# ---------------------------------------------------------------- matrix product
class MatMul(Function):
    """a @ b with NumPy's rules: 1-D operands are promoted, leading dimensions broadcast."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        ga = gb = None
        if a.ndim == 1 and b.ndim == 1:                 # dot product: g is a scalar
            return (g * b if need[0] else None), (g * a if need[1] else None)
        if a.ndim == 1:                                 # (n) @ (..., n, m) -> (..., m)
            if need[0]:
                ga = unbroadcast((g[..., None, :] @ b.swapaxes(-1, -2))[..., 0, :], a.shape)
            if need[1]:
                gb = a[:, None] * g[..., None, :]
            return ga, gb
        if b.ndim == 1:                                 # (..., n, k) @ (k) -> (..., n)
            if need[0]:
                ga = g[..., None] * b
            if need[1]:
                gb = unbroadcast((a.swapaxes(-1, -2) @ g[..., None])[..., 0], b.shape)
            return ga, gb
        if need[0]:
            ga = unbroadcast(g @ b.swapaxes(-1, -2), a.shape)
        if need[1]:
            if b.ndim == 2 and a.ndim > 2:              # (..., n, k) @ (k, m): fold the batch into rows
                gb = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            else:
                gb = unbroadcast(a.swapaxes(-1, -2) @ g, b.shape)
        return ga, gb


def matmul_rows(x, w):
    """x (..., k) @ w (k, n) as one (rows, k) @ (k, n) product. On the GPU this is one cuBLAS GEMM
    (CuPy reads a transposed w in place); CuPy's matmul of a 3-D x would copy w to contiguous memory
    and run a batched GEMM per call. (The CPU keeps NumPy's matmul, and its exact results.)"""
    if not is_device_array(x) or x.ndim == 2:
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[-1],))


class Linear(Function):
    """y = x @ W.T + b with W of shape (out, in), as torch.nn.functional.linear. One graph node
    for the whole layer keeps per-op overhead low."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        out = matmul_rows(x, weight.T)
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = matmul_rows(g, weight) if need[0] else None
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if need[1] else None
        gb = kernels.sum_leading(g2, 1) if len(need) > 2 and need[2] else None
        return gx, gw, gb


# ---------------------------------------------------------------- reductions
def _norm_axis(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(a % ndim for a in axis)


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
        return array_module(a).asarray(a.sum(axis=axis, keepdims=keepdims))

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
        return array_module(a).asarray(a.mean(axis=axis, keepdims=keepdims))

    @staticmethod
    def backward(ctx, g):
        count = 1
        for ax in ctx.axes:
            count *= ctx.shape[ax]
        g = _expand(g, ctx.shape, ctx.axes, ctx.keepdims) * (1.0 / count)
        return array_module(g).broadcast_to(g, ctx.shape)


class Max(Function):
    """Maximum over axes. The gradient is shared equally between tied maxima (as torch.amax)."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.axes = _norm_axis(axis, a.ndim)
        ctx.keepdims = keepdims
        out = a.max(axis=axis, keepdims=True)
        ctx.save_for_backward(a, out)
        return array_module(a).asarray(out if keepdims else out.reshape(
            [n for i, n in enumerate(a.shape) if i not in ctx.axes]))

    @staticmethod
    def backward(ctx, g):
        a, out = ctx.saved_tensors
        mask = a == out
        count = mask.sum(axis=ctx.axes, keepdims=True)
        return _expand(g, a.shape, ctx.axes, ctx.keepdims) * mask / count


# ---------------------------------------------------------------- shape and indexing
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
    """out = value where mask else a (mask is a boolean array, broadcast against a)."""

    @staticmethod
    def forward(ctx, a, mask, value):
        ctx.mask = mask
        return array_module(a).where(mask, value, a)

    @staticmethod
    def backward(ctx, g):
        return array_module(g).where(ctx.mask, 0, g), None, None


# ---------------------------------------------------------------- activations
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
        t = array_module(x).tanh(_GELU_C * (x + 0.044715 * x * x * x))
        ctx.save_for_backward(x, t)
        return 0.5 * x * (1.0 + t)

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        if is_device_array(g):
            return kernels.gelu_backward(g, x, t)
        dinner = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


class Softmax(Function):
    """softmax(x) along ``axis``; attention's form softmax(where(mask, -inf, x·scale)) in one op, so
    that the GPU scales and masks in one fused pass and backward (which is 0 where masked) in one."""

    @staticmethod
    def forward(ctx, x, axis=-1, scale=None, mask=None):
        ctx.axis, ctx.scale = axis, scale
        if is_device_array(x):
            if scale is not None or mask is not None:
                x = kernels.scale_and_mask(x, 1.0 if scale is None else scale, mask)
            out = kernels.softmax(x, axis)
        else:
            xp = array_module(x)
            if scale is not None:
                x = x * scale
            if mask is not None:
                x = xp.where(mask, -math.inf, x)
            e = xp.exp(x - x.max(axis=axis, keepdims=True))
            out = e / e.sum(axis=axis, keepdims=True)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        if is_device_array(g):
            return kernels.softmax_backward(out, g, ctx.axis, 1.0 if ctx.scale is None else ctx.scale)
        gx = out * (g - (g * out).sum(axis=ctx.axis, keepdims=True))   # 0 where masked (out is 0 there)
        return gx if ctx.scale is None else gx * ctx.scale


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


def check_targets(t, classes):
    """IndexError unless every target lies in [0, classes). On device arrays this reads the targets'
    range back (one counted copy, a synchronisation): the device path does it only when asked
    (cross_entropy's validate_targets=True)."""
    if not t.size:
        return
    if is_device_array(t):
        lo, hi = (int(v) for v in to_host(array_module(t).stack([t.min(), t.max()])))
    else:
        lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= classes:
        raise IndexError(f"cross_entropy: targets must lie in [0, {classes}), found {lo}..{hi}")


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


class Dropout(Function):
    """Zero each element with probability p and scale the rest by 1/(1-p) (inverted dropout).
    The mask comes from minitrain.random, so recomputation can replay it by restoring the state.
    With ``full_shape`` and ``index``, x is the slice ``index`` of a tensor of ``full_shape`` split
    across ranks (tensor parallelism): the whole tensor's mask is drawn, as one process would, and
    its slice kept, so the ranks' masks put together are one process's mask."""

    @staticmethod
    def forward(ctx, x, p, full_shape=None, index=None):
        if is_device_array(x):          # drawn on the device from one host seed; a bool mask is kept
            draw = _random.device_uniform(*(x.shape if full_shape is None else full_shape), dtype=x.dtype)
            ctx.scale = 1.0 / (1.0 - p)
            out, keep = kernels.dropout(x, draw if index is None else draw[index], p, ctx.scale)
            ctx.save_for_backward(keep)
            return out
        draw = _random.rand(*(x.shape if full_shape is None else full_shape), dtype=x.dtype)
        keep = (draw if index is None else draw[index]) >= p
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

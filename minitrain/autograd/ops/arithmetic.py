"""Elementwise arithmetic (+, -, *, /, unary minus, **, exp, log, tanh, a dtype cast), and unbroadcast:
the one helper that undoes NumPy broadcasting in every backward (a gradient summed back to its input's shape).
"""
import numpy as np

from ... import kernels
from ...backend import array_module
from ..function import Function


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
    """a ** b, for a tensor base and a number or tensor exponent. As PyTorch, where the formulas read
    0 * inf or 0 * log(0) the gradient is 0: d(a^0)/da = 0 (also at a = 0), and d(0^b)/db = 0 for b >= 0."""

    @staticmethod
    def forward(ctx, a, b):
        out = a ** b
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved_tensors
        need = ctx.needs_input_grad
        xp = array_module(out)
        ga = gb = None
        with np.errstate(divide="ignore", invalid="ignore"):     # the values where() replaces
            if need[0]:
                if isinstance(b, (int, float)):
                    ga = xp.zeros_like(a) if b == 0 else g * b * a ** (b - 1)
                else:
                    ga = xp.where(b == 0, 0.0, g * b * a ** (b - 1))
                ga = unbroadcast(ga, _shape(a))
            if need[1]:
                gb = unbroadcast(xp.where((a == 0) & (b >= 0), 0.0, g * out * xp.log(a)), _shape(b))
        return ga, gb


class Cast(Function):
    """``x.to(dtype)``: a copy in another dtype; the gradient goes back in the input's dtype
    (mixed precision casts weights down and logits up through this)."""

    keeps_input_dtype = False

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

"""Grader: the learner's LayerNorm backward (input, weight and bias gradients) against central
differences, minitrain's fused LayerNorm and PyTorch's layer_norm, on 2-D and 3-D inputs."""
import numpy as np

from ..grading import Check, Mismatch
from ..oracles import call_backward, expect_grad, need_torch, numerical

TITLE = "backward of LayerNorm (input, weight and bias)"
ORDER = 30
KIND = "implement"
NOTEBOOK = "01_autograd"
DEFINES = "layer_norm_backward"
EPS = 1e-5

STUB = '''"""Exercise layer_norm_backward: the backward of layer normalisation (Ba et al. 2016), in every
transformer block twice.

Forward, over the last axis (C features): mean and biased variance var of each row,
    rstd = 1 / sqrt(var + eps),  xhat = (x - mean) * rstd,  y = xhat * weight + bias
with weight and bias of shape (C,). Forward saves xhat and rstd (shape (..., 1)).

Write layer_norm_backward(xhat, rstd, weight, grad): grad is dL/dy, of shape (..., C) (2-D or
3-D); return (grad_x, grad_weight, grad_bias) with the shapes of x, weight and bias, new arrays
(leave the inputs as they are: autograd may hand the same grad to several backward functions).

The test to pass: central differences in float64 for all three gradients (minitrain.testing.
numerical_grad), minitrain's own fused LayerNorm, and PyTorch's layer_norm when torch is
installed, on (rows, C) and (batch, time, C) inputs.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check layer_norm_backward mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check layer_norm_backward mine.py
Stuck?     python -m minitrain.exercises hint layer_norm_backward
"""
import numpy as np


def layer_norm_backward(xhat, rstd, weight, grad):
    raise NotImplementedError("layer_norm_backward: return (grad_x, grad_weight, grad_bias)")
'''

HINTS = (
    "Start with the easy two. y = xhat * weight + bias: every row adds bias once, so grad_bias is "
    "grad summed over every axis but the last; grad_weight is (grad * xhat) summed the same way. "
    "Then the input: first the gradient with respect to xhat, dxhat = grad * weight.",
    "xhat depends on x directly, but also through the row's mean and its variance, so dL/dx has three "
    "terms: the direct one, rstd * dxhat; minus the mean of it over the row (the mean term); and "
    "minus a term along xhat from the variance. All three are scaled by rstd.",
    "grad_x = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, "
    "keepdims=True)). For a 3-D input the weight and bias gradients sum over both leading axes: "
    "sum(axis=tuple(range(grad.ndim - 1))).",
)


def _forward(x, w, b):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + EPS)
    xhat = (x - mean) * rstd
    return xhat * w + b, xhat, rstd


def _case(shape, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = rng.standard_normal(shape) * 2 + 0.5
    w, b = 1 + 0.3 * rng.standard_normal(c), 0.2 * rng.standard_normal(c)
    grad = rng.standard_normal(shape)
    return x, w, b, grad, f"LayerNorm of a {shape} input"


def _learner(impl, x, w, b, grad, case):
    _, xhat, rstd = _forward(x, w, b)
    gx, gw, gb = call_backward(impl, {"xhat": xhat, "rstd": rstd, "weight": w, "grad": grad}, 3,
                               f"layer_norm_backward ({case})")
    for name, got, want in (("grad_x", gx, x), ("grad_weight", gw, w), ("grad_bias", gb, b)):
        if got.shape != want.shape:
            extra = " (sum over every leading axis)" if name != "grad_x" and got.ndim > 1 else ""
            raise Mismatch(f"{case}: {name} has shape {got.shape}, expected {want.shape}{extra}")
    return gx, gw, gb


def _central(impl, shape, which):
    x, w, b, grad, case = _case(shape)
    got = dict(zip(("x", "weight", "bias"), _learner(impl, x, w, b, grad, case)))

    def loss():
        return float((grad * _forward(x, w, b)[0]).sum())
    for name in which:
        array = {"x": x, "weight": w, "bias": b}[name]
        expect_grad(got[name], numerical(loss, array), f"{case}: grad_{name} vs central differences")


def _library(impl):
    import minitrain as mt
    from minitrain.nn import functional as F
    for shape in ((4, 6), (2, 3, 5)):
        x, w, b, grad, case = _case(shape, seed=1)
        tx, tw, tb = (mt.Tensor(a, requires_grad=True) for a in (x, w, b))
        F.layer_norm(tx, shape[-1], tw, tb, eps=EPS).backward(grad)
        for name, got, want in zip(("x", "weight", "bias"), _learner(impl, x, w, b, grad, case),
                                   (tx.grad, tw.grad, tb.grad)):
            expect_grad(got, want, f"{case}: grad_{name} vs minitrain's LayerNorm", atol=1e-10, rtol=1e-9)


def _torch(impl):
    torch = need_torch()
    for shape in ((4, 6), (2, 3, 5)):
        x, w, b, grad, case = _case(shape, seed=2)
        tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
        torch.nn.functional.layer_norm(tx, (shape[-1],), tw, tb, eps=EPS).backward(torch.tensor(grad))
        for name, got, want in zip(("x", "weight", "bias"), _learner(impl, x, w, b, grad, case),
                                   (tx.grad, tw.grad, tb.grad)):
            expect_grad(got, want.numpy(), f"{case}: grad_{name} vs PyTorch", atol=1e-10, rtol=1e-9)


def checks():
    return [Check("(4, 6) input: grad_bias and grad_weight by central differences",
                  lambda f: _central(f, (4, 6), ("bias", "weight")), 1),
            Check("(4, 6) input: grad_x by central differences", lambda f: _central(f, (4, 6), ("x",)), 2),
            Check("(2, 3, 5) input: all three by central differences",
                  lambda f: _central(f, (2, 3, 5), ("x", "weight", "bias")), 3),
            Check("equal to minitrain's LayerNorm", _library, 2),
            Check("equal to PyTorch's layer_norm", _torch, 2)]


def reference():
    import minitrain as mt
    from minitrain.backend import array_module
    from minitrain.nn import functional as F

    def layer_norm_backward(xhat, rstd, weight, grad):
        # xhat has mean 0 and variance 1 - eps·rstd²: x = xhat / rstd gives back the same xhat and rstd
        x = mt.Tensor(xhat / rstd, requires_grad=True)
        w = mt.Tensor(weight, requires_grad=True)
        b = mt.Tensor(array_module(weight).zeros_like(weight), requires_grad=True)
        F.layer_norm(x, weight.shape[-1], w, b, eps=EPS).backward(grad)
        return x.grad, w.grad, b.grad
    return layer_norm_backward

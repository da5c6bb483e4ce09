"""Grader: the learner's softmax backward against central differences, minitrain's Softmax and
PyTorch, along the last axis, along axis 0 and along the middle axis of a 3-D input."""
import numpy as np

from ..grading import Check, Mismatch
from ..oracles import call_backward, expect_grad, need_torch, numerical

TITLE = "backward of softmax, from its output"
ORDER = 20
KIND = "implement"
NOTEBOOK = "01_autograd"
DEFINES = "softmax_backward"

STUB = '''"""Exercise softmax_backward: the backward of softmax, the heart of attention and of the
cross-entropy loss.

out = softmax(x, axis): out = exp(x) / sum(exp(x)) along axis (each slice along axis sums to 1).
Forward saves out, so backward receives out, not x.

Write softmax_backward(out, grad, axis=-1): grad is dL/dout for some scalar loss L; return dL/dx
(x's shape, a new NumPy array). Do not form the Jacobian matrix: it is (n x n) per slice.

The test to pass: central differences in float64 (minitrain.testing.numerical_grad), minitrain's
own Softmax and PyTorch's when torch is installed; along the last axis, along axis 0, and along
the middle axis of a 3-D input.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check softmax_backward mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check softmax_backward mine.py
Stuck?     python -m minitrain.exercises hint softmax_backward
"""
import numpy as np


def softmax_backward(out, grad, axis=-1):
    raise NotImplementedError("softmax_backward: return dL/dx")
'''

HINTS = (
    "Every output of a slice depends on every input of that slice (through the sum in the "
    "denominator): d out_i / d x_j = out_i * (delta_ij - out_j). So dL/dx_j sums grad_i times that "
    "over i, within the slice.",
    "Multiply it out: dL/dx_j = out_j * grad_j - out_j * sum_i(grad_i * out_i) = out_j * (grad_j - "
    "s), where s = sum over the slice of grad * out: one number per slice.",
    "s must be summed along axis only, and kept as a size-1 axis so that it broadcasts back: "
    "s = (grad * out).sum(axis=axis, keepdims=True); return out * (grad - s). Summing over the "
    "whole array, or along the wrong axis, passes for one slice and fails for many.",
)


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _case(shape, axis, seed=0):
    rng = np.random.default_rng(seed)
    x, grad = rng.standard_normal(shape), rng.standard_normal(shape)
    return x, grad, f"softmax over axis {axis} of a {shape} input"


def _learner(impl, out, grad, axis, case):
    (gx,) = call_backward(impl, {"out": out, "grad": grad}, 1, f"softmax_backward ({case})", axis=axis)
    if gx.shape != out.shape:
        raise Mismatch(f"{case}: dL/dx has shape {gx.shape}, expected {out.shape}")
    return gx


def _central(impl, shape, axis):
    x, grad, case = _case(shape, axis)
    gx = _learner(impl, _softmax(x, axis), grad, axis, case)
    want = numerical(lambda: float((grad * _softmax(x, axis)).sum()), x)
    expect_grad(gx, want, f"{case}: dL/dx vs central differences")


def _library(impl):
    import minitrain as mt
    from minitrain.nn import functional as F
    for shape, axis in (((3, 5), -1), ((4, 3), 0), ((2, 3, 4), 1)):
        x, grad, case = _case(shape, axis, seed=1)
        t = mt.Tensor(x, requires_grad=True)
        F.softmax(t, axis=axis).backward(grad)
        expect_grad(_learner(impl, _softmax(x, axis), grad, axis, case), t.grad,
                    f"{case}: dL/dx vs minitrain's Softmax", atol=1e-12, rtol=1e-10)


def _torch(impl):
    torch = need_torch()
    for shape, axis in (((3, 5), -1), ((2, 3, 4), 1)):
        x, grad, case = _case(shape, axis, seed=2)
        t = torch.tensor(x, requires_grad=True)
        torch.softmax(t, dim=axis).backward(torch.tensor(grad))
        expect_grad(_learner(impl, _softmax(x, axis), grad, axis, case), t.grad.numpy(),
                    f"{case}: dL/dx vs PyTorch", atol=1e-12, rtol=1e-10)


def checks():
    return [Check("rows of a (3, 5) input, axis=-1: central differences", lambda f: _central(f, (3, 5), -1), 2),
            Check("columns of a (4, 3) input, axis=0: central differences", lambda f: _central(f, (4, 3), 0), 3),
            Check("the middle axis of a (2, 3, 4) input: central differences", lambda f: _central(f, (2, 3, 4), 1), 3),
            Check("equal to minitrain's Softmax", _library, 2),
            Check("equal to PyTorch's softmax backward", _torch, 2)]


def reference():
    import minitrain as mt
    from minitrain.backend import array_module
    from minitrain.nn import functional as F

    def softmax_backward(out, grad, axis=-1):
        # minitrain's Softmax saves its output; rebuilding x = log(out) gives the same softmax
        t = mt.Tensor(array_module(out).log(out), requires_grad=True)
        F.softmax(t, axis=axis).backward(grad)
        return t.grad
    return softmax_backward

"""Grader: the learner's gradients against central differences (minitrain.testing.numerical_grad),
minitrain's own MatMul backward and PyTorch's autograd, on non-square, square (where a missing
transpose still has the right shape) and batched shapes."""
import numpy as np

from ..grading import Check, Mismatch
from ..oracles import call_backward, expect_grad, need_torch, numerical

TITLE = "backward of the matrix product y = a @ b (plain and batched)"
ORDER = 10
KIND = "implement"
NOTEBOOK = "01_autograd"
DEFINES = "matmul_backward"

STUB = '''"""Exercise matmul_backward: the gradients of a matrix product, the backward of every Linear layer.

Write matmul_backward(a, b, grad) for y = a @ b, where
  a has shape (n, k), or (B, n, k) for a batch of B matrices,
  b has shape (k, m): one matrix shared by the whole batch (as a Linear layer's weight),
  grad is dL/dy for some scalar loss L: y's shape, (n, m) or (B, n, m).

Return (grad_a, grad_b): dL/da with a's shape and dL/db with b's shape, new NumPy arrays.

The test to pass: central differences in float64 (minitrain.testing.numerical_grad), minitrain's own
MatMul, and PyTorch's autograd when torch is installed; non-square shapes, square ones (where a
forgotten transpose keeps the right shape) and a batch.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check matmul_backward mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check matmul_backward mine.py
Stuck?     python -m minitrain.exercises hint matmul_backward
"""
import numpy as np


def matmul_backward(a, b, grad):
    raise NotImplementedError("matmul_backward: return (grad_a, grad_b)")
'''

HINTS = (
    "Write one element: y[i, j] = sum over k of a[i, k] * b[k, j]. Then dL/da[i, k] = sum over j of "
    "grad[i, j] * b[k, j], and dL/db[k, j] = sum over i of a[i, k] * grad[i, j]. Each is a matrix "
    "product: which matrices, and which of them transposed?",
    "grad_a = grad @ b.T has a's shape (n, k), and grad_b = a.T @ grad has b's shape (k, m). Check the "
    "shapes first: most transposition bugs change a shape, and the ones that do not (square matrices) "
    "are exactly why the grader also tests square ones.",
    "With a batch, every matrix of the batch uses the same b, so b's gradient is the sum of every "
    "batch element's a[t].T @ grad[t]: sum over the batch axis (one product does it: "
    "a.reshape(-1, k).T @ grad.reshape(-1, m)). a's gradient needs no sum: each batch element has "
    "its own a, grad_a = grad @ b.T works for both shapes.",
)


def _data(shape_a, shape_b, seed=0):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(shape_a), rng.standard_normal(shape_b)
    grad = rng.standard_normal(shape_a[:-1] + shape_b[-1:])
    return a, b, grad


def _learner(impl, a, b, grad, case):
    ga, gb = call_backward(impl, {"a": a, "b": b, "grad": grad}, 2, f"matmul_backward {case}")
    if ga.shape != a.shape:
        raise Mismatch(f"{case}: grad_a has shape {ga.shape}, but a has shape {a.shape} (a gradient has "
                       "the shape of what it is the gradient of)")
    if gb.shape != b.shape:
        raise Mismatch(f"{case}: grad_b has shape {gb.shape}, but b has shape {b.shape}" +
                       (": b is shared by the batch, so its gradient sums over it" if gb.ndim > b.ndim else ""))
    return ga, gb


def _central(impl, shape_a, shape_b):
    a, b, grad = _data(shape_a, shape_b)
    case = f"a {shape_a} @ b {shape_b}"
    ga, gb = _learner(impl, a, b, grad, case)
    want_a = numerical(lambda: float((grad * (a @ b)).sum()), a)
    want_b = numerical(lambda: float((grad * (a @ b)).sum()), b)
    expect_grad(ga, want_a, f"{case}: grad_a vs central differences")
    expect_grad(gb, want_b, f"{case}: grad_b vs central differences")


def _library(impl, shape_a, shape_b):
    import minitrain as mt
    a, b, grad = _data(shape_a, shape_b, seed=1)
    case = f"a {shape_a} @ b {shape_b}"
    ga, gb = _learner(impl, a, b, grad, case)
    ta, tb = mt.Tensor(a, requires_grad=True), mt.Tensor(b, requires_grad=True)
    (ta @ tb).backward(grad)
    expect_grad(ga, ta.grad, f"{case}: grad_a vs minitrain's MatMul", atol=1e-12, rtol=1e-10)
    expect_grad(gb, tb.grad, f"{case}: grad_b vs minitrain's MatMul", atol=1e-12, rtol=1e-10)


def _torch(impl):
    torch = need_torch()
    for shape_a, shape_b in (((3, 4), (4, 5)), ((2, 3, 4), (4, 5))):
        a, b, grad = _data(shape_a, shape_b, seed=2)
        case = f"a {shape_a} @ b {shape_b}"
        ga, gb = _learner(impl, a, b, grad, case)
        ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
        (ta @ tb).backward(torch.tensor(grad))
        expect_grad(ga, ta.grad.numpy(), f"{case}: grad_a vs PyTorch", atol=1e-12, rtol=1e-10)
        expect_grad(gb, tb.grad.numpy(), f"{case}: grad_b vs PyTorch", atol=1e-12, rtol=1e-10)


def checks():
    return [Check("a (3, 4) @ b (4, 5): shapes and central differences", lambda f: _central(f, (3, 4), (4, 5)), 1),
            Check("a (4, 4) @ b (4, 4), square: equal to minitrain's MatMul", lambda f: _library(f, (4, 4), (4, 4)), 2),
            Check("a batch, (2, 3, 4) @ (4, 5): central differences", lambda f: _central(f, (2, 3, 4), (4, 5)), 3),
            Check("a square batch, (3, 4, 4) @ (4, 4): equal to minitrain's MatMul",
                  lambda f: _library(f, (3, 4, 4), (4, 4)), 3),
            Check("equal to PyTorch's autograd (plain and batched)", _torch, 2)]


def reference():
    import minitrain as mt

    def matmul_backward(a, b, grad):
        ta, tb = mt.Tensor(a, requires_grad=True), mt.Tensor(b, requires_grad=True)
        (ta @ tb).backward(grad)
        return ta.grad, tb.grad
    return matmul_backward

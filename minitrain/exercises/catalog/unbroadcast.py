"""Grader: the learner's unbroadcast against minitrain's own (exactly) on leading, stretched and
mixed broadcast axes and a scalar, and the gradient of a broadcasting a + b * c by central
differences through it."""
import numpy as np

from ..comparing import as_array, host, to_learner
from ..grading import Check, Mismatch
from ..oracles import expect_grad, numerical

TITLE = "gradient reduction over broadcast axes (unbroadcast)"
ORDER = 40
KIND = "implement"
NOTEBOOK = "01_autograd"
DEFINES = "unbroadcast"

STUB = '''"""Exercise unbroadcast: the one helper behind every elementwise op's backward.

NumPy broadcasting lets a (3,) bias be added to a (4, 3) batch, or a (4, 1) column be multiplied
into it. Forward is free; backward must give each input a gradient of the input's own shape.

Write unbroadcast(grad, shape): grad is the gradient of the broadcast result (grad.shape is what
the operands broadcast to); return the gradient of an operand of shape `shape` (a tuple, () for a
scalar), a NumPy array of exactly that shape.

The test to pass: minitrain's own unbroadcast, exactly, on
    leading axes broadcasting added      (4, 3) -> (3,)      (5, 2, 3) -> (3,)
    axes stretched from size 1           (4, 3) -> (4, 1)    (4, 3) -> (1, 3)
    both at once, and a scalar           (5, 2, 4, 3) -> (2, 1, 3)    (2, 3) -> ()
then the gradient of a + b * c with broadcasting operands by central differences.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check unbroadcast mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check unbroadcast mine.py
Stuck?     python -m minitrain.exercises hint unbroadcast
"""
import numpy as np


def unbroadcast(grad, shape):
    raise NotImplementedError("unbroadcast: reduce grad to shape")
'''

HINTS = (
    "Broadcasting uses one element of the operand in many places of the result, so in backward the "
    "gradients of all those places add up into that element: a sum, never a mean.",
    "There are two kinds of broadcast axes. Leading axes that the operand does not have at all (a "
    "(3,) bias in a (4, 3) result): sum them away. Axes where the operand has size 1 but the result "
    "has more: sum them, keeping the axis (keepdims=True), so the result has a 1 there.",
    "First grad = grad.sum(axis=tuple(range(grad.ndim - len(shape)))) for the leading ones; then "
    "the axes i where shape[i] == 1 and grad.shape[i] != 1, summed with keepdims=True. A scalar "
    "shape () sums everything; return an array of shape () (np.asarray of the sum).",
)

LEADING = (((4, 3), (3,)), ((5, 2, 3), (3,)), ((2, 3), (2, 3)))
STRETCHED = (((4, 3), (4, 1)), ((4, 3), (1, 3)), ((2, 3, 4), (2, 1, 4)))
MIXED = (((5, 2, 4, 3), (2, 1, 3)), ((2, 3), ()), ((2, 3), (1, 1)), ((3, 1, 2), (1, 2)))


def _cases(impl, cases):
    from minitrain.autograd.ops import unbroadcast as library
    rng = np.random.default_rng(0)
    for big, small in cases:
        grad = rng.integers(-9, 10, big).astype(np.float64)
        case = f"unbroadcast(grad of shape {big}, {small})"
        value = impl(to_learner(grad), small)
        got = np.asarray(value) if isinstance(value, (float, int, np.generic)) else as_array(value, case)
        want = host(library(grad, small))
        if got.shape != want.shape:
            note = " (keep the size-1 axes: keepdims=True)" if got.ndim < want.ndim and 1 in small else ""
            raise Mismatch(f"{case}: shape {got.shape}, expected {want.shape}{note}")
        expect_grad(got, want, case, atol=0, rtol=0)


def _central(impl):
    rng = np.random.default_rng(1)
    a, b, c = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 1)), rng.standard_normal((4,))
    g = rng.standard_normal((2, 3, 4))

    def loss():
        return float((g * (a + b * c)).sum())
    for name, array, local in (("a (2, 3, 4)", a, g), ("b (3, 1)", b, g * c), ("c (4,)", c, g * b)):
        got = impl(to_learner(local), array.shape)
        expect_grad(got, numerical(loss, array),
                    f"gradient of a + b * c with respect to {name}, through unbroadcast, vs central differences")


def checks():
    return [Check("leading axes that broadcasting added are summed away", lambda f: _cases(f, LEADING), 1),
            Check("axes stretched from size 1 are summed, keeping the 1", lambda f: _cases(f, STRETCHED), 2),
            Check("both at once, and a scalar", lambda f: _cases(f, MIXED), 3),
            Check("a + b * c with broadcasting: central differences", _central, 2)]


def reference():
    from minitrain.autograd.ops import unbroadcast
    return unbroadcast

"""Sums away the leading axes only, forgetting the axes stretched from size 1."""
import numpy as np


def unbroadcast(grad, shape):
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))
    return np.asarray(grad)

EXPECT = ['shape', 'expected (4, 1)']

"""Sums the stretched axes without keepdims: the size-1 axes disappear."""
import numpy as np


def unbroadcast(grad, shape):
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes)
    return np.asarray(grad)

EXPECT = ['keepdims']

"""Averages over the broadcast axes instead of summing."""
import numpy as np


def unbroadcast(grad, shape):
    grad = grad.mean(axis=tuple(range(grad.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return np.asarray(grad)

EXPECT = ['element', 'expected']

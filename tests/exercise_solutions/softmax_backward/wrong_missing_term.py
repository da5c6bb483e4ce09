"""Returns out * grad: the diagonal of the Jacobian only, the term through the normalisation is missing."""
import numpy as np


def softmax_backward(out, grad, axis=-1):
    s = (grad * out).sum(axis=axis, keepdims=True)
    return out * grad

EXPECT = ['central differences', 'element']

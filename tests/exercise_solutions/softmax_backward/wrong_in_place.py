"""Right numbers, but computed in grad's own memory and returned: the caller's gradient is overwritten."""
import numpy as np


def softmax_backward(out, grad, axis=-1):
    s = (grad * out).sum(axis=axis, keepdims=True)
    grad -= s
    grad *= out
    return grad

EXPECT = ['changed its input grad in place']

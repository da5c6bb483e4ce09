"""Always normalises along the last axis, whatever axis says."""
import numpy as np


def softmax_backward(out, grad, axis=-1):
    s = (grad * out).sum(axis=-1, keepdims=True)
    return out * (grad - s)

EXPECT = ['axis 0', 'element']

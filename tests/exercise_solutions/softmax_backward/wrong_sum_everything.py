"""Sums grad * out over the whole array instead of along the axis: right for one row, wrong for many."""
import numpy as np


def softmax_backward(out, grad, axis=-1):
    s = (grad * out).sum()
    return out * (grad - s)

EXPECT = ['element', 'expected']

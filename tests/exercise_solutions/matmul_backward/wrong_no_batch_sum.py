"""grad_b keeps one gradient per batch element instead of summing them."""
import numpy as np


def matmul_backward(a, b, grad):
    grad_a = grad @ b.T
    grad_b = a.swapaxes(-1, -2) @ grad
    return grad_a, grad_b

EXPECT = ['grad_b has shape', 'sums over it']

"""grad_a = grad @ b: a transpose forgotten (square matrices hide it, non-square ones do not)."""
import numpy as np


def matmul_backward(a, b, grad):
    grad_a = grad @ b
    grad_b = a.reshape(-1, a.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])
    return grad_a, grad_b

EXPECT = ['ValueError', 'line']

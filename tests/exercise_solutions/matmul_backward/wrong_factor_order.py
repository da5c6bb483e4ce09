"""grad_b = grad.T @ a: the factors in the wrong order, giving b's transpose (m, k) instead of (k, m)."""
import numpy as np


def matmul_backward(a, b, grad):
    grad_a = grad @ b.T
    grad_b = grad.reshape(-1, grad.shape[-1]).T @ a.reshape(-1, a.shape[-1])
    return grad_a, grad_b


EXPECT = ["grad_b has shape (5, 4)", "b has shape (4, 5)"]

"""A learner's matmul backward."""
import numpy as np


def matmul_backward(a, b, grad):
    grad_a = grad @ b.T
    grad_b = a.reshape(-1, a.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])
    return grad_a, grad_b

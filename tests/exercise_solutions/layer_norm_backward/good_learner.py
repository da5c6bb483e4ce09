"""A learner's LayerNorm backward."""
import numpy as np


def layer_norm_backward(xhat, rstd, weight, grad):
    lead = tuple(range(grad.ndim - 1))
    grad_bias = grad.sum(axis=lead)
    grad_weight = (grad * xhat).sum(axis=lead)
    dxhat = grad * weight
    grad_x = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                     - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return grad_x, grad_weight, grad_bias

"""Gradient clipping by global norm: g *= max_norm / (||g||_2 + 1e-6) when the norm exceeds max_norm,
where ||g|| is the norm of all gradients together (torch.nn.utils.clip_grad_norm_)."""
import math


def grad_norm_squared(parameters):
    """Sum of squared gradient entries (ZeRO adds these partial sums across shards)."""
    total = 0.0
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            total += float((g * g).sum())
    return total


def clip_grad_norm_(parameters, max_norm, total_norm=None):
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; returns the
    norm before clipping. ``total_norm`` may be passed when it was computed elsewhere (across shards)."""
    parameters = [p for p in parameters if p.grad is not None]
    if total_norm is None:
        total_norm = math.sqrt(grad_norm_squared(parameters))
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in parameters:
            p.grad *= coef
    return total_norm

"""Gradient clipping by global norm: g *= max_norm / (||g||_2 + 1e-6) when the norm exceeds max_norm,
where ||g|| is the norm of all gradients together (torch.nn.utils.clip_grad_norm_).
On the GPU nothing is read back: the norm stays a 0-d device array and every gradient is multiplied
by min(1, coef) (as PyTorch does), so clipping costs no synchronisation; on the CPU the norm is a float."""
import math

import numpy as np

from .. import kernels
from ..backend import array_module, is_device_array


def grad_norm_squared(parameters):
    """Sum of squared gradient entries (ZeRO adds these partial sums across shards): a float, or a
    0-d float64 device array when the gradients are on the GPU."""
    # fp16 / bf16 gradients squared in their own precision overflow past |g| = 256: widened first
    grads = [g if g.dtype.itemsize >= 4 else g.astype(np.float32) for g in
             (p.grad for p in parameters if p.grad is not None)]
    if grads and is_device_array(grads[0]):
        xp = array_module(grads[0])
        return xp.stack([kernels.square_sum(g) for g in grads]).astype(np.float64).sum()
    total = 0.0
    for g in grads:
        total += float((g * g).sum())
    return total


def sum_of_squares(arrays, like=None):
    """The sum of the arrays' squared entries in float64, as a one-element array on their device
    (when there are none, on ``like``'s, else the host): what this rank adds to the global norm's square."""
    arrays = list(arrays)
    total = (array_module(arrays[0]) if arrays else np if like is None else array_module(like)).zeros(1)
    for a in arrays:
        a64 = a.astype(np.float64)
        total += (a64 * a64).sum()
    return total


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, *, total_norm=None):
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; returns the
    norm before clipping (torch.nn.utils.clip_grad_norm_'s call shape; the L2 norm only).
    ``parameters``: an iterable of tensors or one tensor (iterating a tensor would give its rows).
    ``total_norm`` (keyword) may be passed when it was computed elsewhere (across shards)."""
    if hasattr(parameters, "shape"):
        parameters = [parameters]
    if norm_type != 2:
        raise ValueError(f"clip_grad_norm_ clips by the L2 norm (norm_type=2), got norm_type={norm_type}")
    parameters = [p for p in parameters if p.grad is not None]
    if total_norm is None:
        total_norm = grad_norm_squared(parameters)
        total_norm = array_module(total_norm).sqrt(total_norm) if is_device_array(total_norm) else math.sqrt(total_norm)
    if error_if_nonfinite and not math.isfinite(float(total_norm)):
        raise RuntimeError(f"the total norm of the gradients is non-finite ({float(total_norm)}), so it cannot be "
                           f"clipped (error_if_nonfinite=True, as PyTorch)")
    if is_device_array(total_norm):
        coef = array_module(total_norm).minimum(max_norm / (total_norm + 1e-6), 1.0)
        for p in parameters:
            p.grad *= coef
        return total_norm
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in parameters:
            p.grad *= coef
    return total_norm

"""Gradient clipping by global norm: g *= max_norm / (||g||_2 + 1e-6) when the norm exceeds max_norm,
where ||g|| is the norm of all gradients together (torch.nn.utils.clip_grad_norm_).
On the GPU nothing is read back: the norm stays a 0-d device array and every gradient is multiplied
by min(1, coef) (as PyTorch does), so clipping costs no synchronisation; on the CPU the norm is a float."""
import math

import numpy as np

from .. import kernels
from ..backend import array_module, is_device_array, is_real


def sum_of_squares(arrays, like=None):
    """The sum of the arrays' squared entries, as a one-element float64 array on their device (when there
    are none, on ``like``'s, else the host): what this rank adds to the global norm's square (the whole
    of it in one process). On the host each square is taken in float64; on the GPU one fused kernel per
    array sums its squares in float32 at least (fp16 / bf16 squares overflow past |g| = 256) and the
    sums meet in float64."""
    arrays = list(arrays)
    if arrays and is_device_array(arrays[0]):
        xp = array_module(arrays[0])
        sums = [kernels.square_sum(a if a.dtype.itemsize >= 4 else a.astype(np.float32)) for a in arrays]
        return xp.stack(sums).astype(np.float64).sum(keepdims=True)
    total = (np if like is None else array_module(like)).zeros(1)
    for a in arrays:
        a64 = a.astype(np.float64)
        total += (a64 * a64).sum()
    return total


def check_max_norm(max_norm, name="clip_grad_norm_"):
    """max_norm is a number >= 0 (inf: the norm measured, nothing clipped): a negative one would flip every
    gradient's sign and NaN make them NaN (PyTorch takes both), with no error."""
    if not (is_real(max_norm) and max_norm >= 0):
        raise ValueError(f"{name}: max_norm must be a number >= 0 (inf: measure the norm, clip nothing), got {max_norm!r}")


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, *, total_norm=None):
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; returns the
    norm before clipping (torch.nn.utils.clip_grad_norm_'s call shape; the L2 norm only).
    ``parameters``: an iterable of tensors or one tensor (iterating a tensor would give its rows).
    ``total_norm`` (keyword) may be passed when it was computed elsewhere (across shards)."""
    check_max_norm(max_norm)
    if hasattr(parameters, "shape"):
        parameters = [parameters]
    if norm_type != 2:
        raise ValueError(f"clip_grad_norm_ clips by the L2 norm (norm_type=2), got norm_type={norm_type}")
    parameters = [p for p in parameters if p.grad is not None]
    if total_norm is None:
        square = sum_of_squares(p.grad for p in parameters)
        total_norm = array_module(square).sqrt(square[0]) if is_device_array(square) else math.sqrt(float(square[0]))
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

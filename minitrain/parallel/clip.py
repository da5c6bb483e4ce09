"""Gradient clipping when the gradient is spread over ranks (ZeRO's shards; Megatron-LM's tensor-
and pipeline-parallel pieces, its clip_grad_norm_fp32). The global L2 norm is the square root of
the sum of every entry's square, each entry counted on exactly one rank: each rank sums the squares
of what it owns (sum_of_squares), the sums are all-reduced over the groups that hold different
pieces, and every rank scales its own gradients by min(1, max_norm / norm), as optim/clip.py does
for one process. Cost: one all-reduce of one float64 per group; on the GPU nothing is read back.
"""
import math

from ..backend import array_module, is_device_array
from ..comm import all_reduce
from ..optim.clip import check_max_norm, clip_grad_norm_, sum_of_squares

__all__ = ["clip_sharded_grad_norm_", "sum_of_squares"]


def clip_sharded_grad_norm_(parameters, max_norm, local_square, groups, loss_scale=1.0):
    """Clip ``parameters``' gradients (this rank's pieces) by the norm of the whole gradient;
    returns that norm. ``local_square``: sum_of_squares of the entries this rank counts (an entry
    held by several ranks, a replicated parameter, is counted on one of them only); ``groups``: the
    communicators to sum over, one after the other (ZeRO: [dp]; tensor x pipeline: [tp, pp]).
    ``loss_scale``: gradients S times too large (mixed precision) have the norm total / S."""
    check_max_norm(max_norm)                    # on every rank before the all-reduce: none waits for a refused one
    square = local_square
    for comm in groups:
        square = all_reduce(comm, square, op="sum")
    if is_device_array(square):                 # stays on the device: no synchronisation
        total = array_module(square).sqrt(square[0]) / loss_scale
    else:
        total = math.sqrt(float(square[0])) / loss_scale
    return clip_grad_norm_(parameters, max_norm, total_norm=total)

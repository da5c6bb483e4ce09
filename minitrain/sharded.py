"""Logical tensors and the slices a rank holds of them: the one vocabulary every strategy shares
with minitrain.checkpoint (PyTorch's DTensor / distributed-checkpoint idea, reduced to a box).

A *logical* tensor is what one process would hold (h.0.mlp.c_fc.weight, shape (4C, C)). A
rank holds pieces of it; each piece is a Slice: the box offsets .. offsets + sizes of the
logical tensor, stored as the elements start .. start + prod(sizes) of one of this rank's flat
arrays (a tensor-parallel shard is one box; a ZeRO flat shard cut across parameters is up to
2·ndim - 1 boxes per parameter, flat_range). Strategies answer sharded_parameters() with
[(local parameter, [(logical name, Slice), ...])]; an optimizer's state arrays are shaped like
the parameter they belong to, so the same slices cut them too. Padding is never part of a slice.
"""
import math
from typing import NamedTuple


class Slice(NamedTuple):
    global_shape: tuple
    offsets: tuple
    sizes: tuple
    start: int = 0        # where the box's first element sits in the holder's flattened array

    @property
    def numel(self):
        return math.prod(self.sizes)

    def view(self, array):
        """The box as a view of ``array`` (the holder: a parameter, a gradient, an optimizer state)."""
        if not array.flags.c_contiguous:
            raise ValueError(f"a sharded array must be contiguous to be cut into slices (shape {array.shape})")
        return array.reshape(-1)[self.start:self.start + self.numel].reshape(self.sizes)


def whole(shape):
    """The slice of a tensor held whole."""
    shape = tuple(int(d) for d in shape)
    return Slice(shape, (0,) * len(shape), shape, 0)


def _boxes(shape, lo, hi):
    """(offsets, sizes) of the boxes that cover the row-major elements [lo, hi) of ``shape``, in order."""
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)
    if r0 == r1:                                   # inside one row: cut that row
        for off, size in _boxes(shape[1:], c0, c1):
            yield (r0,) + off, (1,) + size
        return
    if c0:                                         # the end of a partial first row
        for off, size in _boxes(shape[1:], c0, inner):
            yield (r0,) + off, (1,) + size
        r0 += 1
    if r1 > r0:                                    # whole rows
        yield (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])
    if c1:                                         # the start of a partial last row
        for off, size in _boxes(shape[1:], 0, c1):
            yield (r1,) + off, (1,) + size


def flat_range(shape, lo, hi, start=0):
    """Slices covering elements [lo, hi) of a tensor of ``shape`` flattened in row-major order,
    held contiguously from ``start`` on (at most 2·ndim - 1 boxes)."""
    shape = tuple(int(d) for d in shape)
    slices = []
    if lo >= hi:
        return slices
    for offsets, sizes in _boxes(shape, lo, hi):
        slices.append(Slice(shape, offsets, sizes, start))
        start += math.prod(sizes)
    return slices


def flat_buffer_slices(entries, lo, hi):
    """The pieces of the logical tensors that the range [lo, hi) of a flat buffer holds.
    ``entries``: (name, shape, offset) of each tensor laid out in the buffer (ZeRO, FSDP);
    the slices' ``start`` counts from ``lo``. Padding after the last tensor yields nothing."""
    pieces = []
    for name, shape, offset in entries:
        size = math.prod(shape)
        a, b = max(offset, lo), min(offset + size, hi)
        if a < b:
            pieces += [(name, s) for s in flat_range(shape, a - offset, b - offset, start=a - lo)]
    return pieces


def intersect(a_offsets, a_sizes, b_offsets, b_sizes):
    """The box common to two boxes, as (offsets, sizes), or None."""
    lo = [max(a, b) for a, b in zip(a_offsets, b_offsets)]
    hi = [min(a + m, b + n) for a, m, b, n in zip(a_offsets, a_sizes, b_offsets, b_sizes)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - low for low, h in zip(lo, hi))


def box_index(offsets, sizes, origin):
    """The numpy index of the box (offsets, sizes) inside an array whose element 0 sits at ``origin``."""
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(offsets, sizes, origin))

"""The layouts of the checkpoint_slice_map exercise's cases: which boxes of a tensor each rank of a
job holds, as the checkpoint saves them. A layout is a function shape -> one list of (offsets, sizes)
boxes per rank: blocks along one axis (tensor parallelism's columns or rows), a grid of blocks,
ZeRO-3's flat shards (as minitrain.sharded.flat_range cuts them into boxes), data-parallel
replicas of another layout, or the whole tensor on one process."""
import math

import numpy as np


def _split(n, parts):
    """(start, length) of np.array_split's parts of range(n)."""
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), parts)])
    return [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def along(axis, parts):
    """Blocks along one axis (tensor parallelism: axis 1 columns, axis 0 rows), one per rank."""
    def boxes(shape):
        out = []
        for start, length in _split(shape[axis], parts):
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[axis], sizes[axis] = start, length
            out.append([(tuple(offsets), tuple(sizes))])
        return out
    return boxes


def grid(rows, cols):
    """A rows x cols grid of blocks over the first two axes (e.g. tp over columns x pp over rows)."""
    def boxes(shape):
        return [[((r0, c0) + (0,) * (len(shape) - 2), (rn, cn) + tuple(shape[2:]))]
                for r0, rn in _split(shape[0], rows) for c0, cn in _split(shape[1], cols)]
    return boxes


def flat(parts):
    """ZeRO-3's flat shards: rank r holds elements [r·S, (r+1)·S) in row-major order, S = ceil(N/p),
    as the boxes minitrain.sharded.flat_range cuts them into (up to 2·ndim - 1 per rank)."""
    def boxes(shape):
        from minitrain.sharded import flat_range
        n = math.prod(shape)
        s = -(-n // parts)
        return [[(sl.offsets, sl.sizes) for sl in flat_range(shape, min(r * s, n), min((r + 1) * s, n))]
                for r in range(parts)]
    return boxes


def replicated(copies, inner):
    """``copies`` data-parallel replicas of the layout ``inner`` (the checkpoint writes each box once)."""
    def boxes(shape):
        return [b for _ in range(copies) for b in inner(shape)]
    return boxes


def whole(shape):
    return [[((0,) * len(shape), tuple(shape))]]

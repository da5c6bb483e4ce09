"""Activation recomputation: checkpoint (see minitrain/autograd/checkpoint.py) and
checkpoint_sequential, Chen et al. (2016)'s scheme for a chain of n layers: cut it into k
segments and keep only each segment's input; in backward, recompute one segment at a time.
Peak saved activations ~ k inputs + one segment's n/k layers of intermediates, smallest at
k ~ sqrt(n): O(sqrt(n)) memory for one extra forward pass (of all segments but the last)."""
import math

from ..autograd.checkpoint import checkpoint


def default_segments(n):
    return max(1, round(math.sqrt(n)))


def checkpoint_sequential(model, segments, x):
    """Run the Sequential ``model`` on ``x`` in ``segments`` contiguous pieces; every piece but the
    last is checkpointed (the last one's activations are needed at once anyway, as in PyTorch)."""
    modules = list(model)
    n = len(modules)
    segments = default_segments(n) if segments is None else segments
    if not 1 <= segments <= max(n, 1):
        raise ValueError(f"checkpoint_sequential: {segments} segments for {n} modules")
    bounds = [round(i * n / segments) for i in range(segments + 1)]

    def run(lo, hi):
        def piece(h):
            for m in modules[lo:hi]:
                h = m(h)
            return h
        return piece

    for i in range(segments):
        lo, hi = bounds[i], bounds[i + 1]
        x = checkpoint(run(lo, hi), x) if i < segments - 1 else run(lo, hi)(x)
    return x


__all__ = ["checkpoint", "checkpoint_sequential", "default_segments"]

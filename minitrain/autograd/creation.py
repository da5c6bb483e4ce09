"""Making tensors, as torch's creation functions: tensor() (a copy of the data), zeros, ones, randn; and
joining or splitting them along an axis (cat, split), each piece a differentiable slice.
"""
from .. import backend
from . import ops
from .tensor import Tensor, _as_array


def tensor(data, requires_grad=False, dtype=None):
    """A new leaf tensor holding a copy of ``data``."""
    arr = _as_array(data, dtype)
    if isinstance(data, Tensor) or arr is data:
        arr = arr.copy()
    return Tensor(arr, requires_grad=requires_grad)


def cat(tensors, axis=0):
    """Concatenate along ``axis`` (torch.cat)."""
    tensors = [t if isinstance(t, Tensor) else Tensor(t) for t in tensors]
    return ops.Cat.apply(*tensors, axis=axis)


def split(t, split_size_or_sections, axis=0):
    """torch.split: an int is the size of each piece (the last may be smaller); a list gives the sizes."""
    n = t.shape[axis]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            raise ValueError("split size must be positive")
        sizes = [min(step, n - start) for start in range(0, n, step)]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to the axis length {n}")
    pieces, start = [], 0
    axis = axis % t.ndim
    for size in sizes:
        idx = (slice(None),) * axis + (slice(start, start + size),)
        pieces.append(t[idx])
        start += size
    return tuple(pieces)


def zeros(*shape, requires_grad=False, dtype=None):
    return Tensor(backend.xp().zeros(shape, dtype=dtype or backend.get_default_dtype()), requires_grad)


def ones(*shape, requires_grad=False, dtype=None):
    return Tensor(backend.xp().ones(shape, dtype=dtype or backend.get_default_dtype()), requires_grad)


def randn(*shape, requires_grad=False, dtype=None):
    from .. import random
    return Tensor(random.randn(*shape, dtype=dtype), requires_grad)

"""``cupyx`` of the stand-in: the scatter operations (``cupyx.scatter_add`` is ``np.add.at`` on the
device: repeated indices accumulate) and pinned host arrays (``empty_pinned`` / ``zeros_pinned``)."""
import numpy as np

import cupy
from cupy import _standin as S
from cupy._core import _index, check_device, ndarray


def _scatter(np_ufunc, a, slices, value):
    if not isinstance(a, ndarray):
        raise TypeError("cupyx.scatter_*: the target must be a cupy.ndarray")
    raw, _, arrays = _index(a, slices)
    if isinstance(value, ndarray):
        arrays.append(value)
        value = value._a
    elif isinstance(value, np.ndarray):
        S.implicit("a scatter value of type numpy.ndarray", value.nbytes)
    check_device([a] + arrays)
    np_ufunc.at(a._a, raw, value)
    S.kernel(f"scatter_{np_ufunc.__name__}")


# CuPy 14.2's atomicAdd types (bfloat16 refused, seen on an H200)
_ADDABLE = tuple(np.dtype(t) for t in (np.int32, np.int64, np.float16, np.float32, np.float64, np.uint32, np.uint64))


def scatter_add(a, slices, value):
    if isinstance(value, (ndarray, np.ndarray)) and value.dtype not in _ADDABLE:
        raise TypeError("cupy.add.at only supports int32, int64, float16, float32, float64, uint32, uint64 as "
                        "data type")
    _scatter(np.add, a, slices, value)


def scatter_max(a, slices, value):
    _scatter(np.maximum, a, slices, value)


def scatter_min(a, slices, value):
    _scatter(np.minimum, a, slices, value)


def empty_pinned(shape, dtype=float, order="C"):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape, order=order)


def zeros_pinned(shape, dtype=float, order="C"):
    out = empty_pinned(shape, dtype, order)
    out[...] = 0
    return out


__all__ = ["scatter_add", "scatter_max", "scatter_min", "empty_pinned", "zeros_pinned"]

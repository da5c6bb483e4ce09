"""What NumPy and CuPy arrays need spelled differently, written once: adding at repeated indices,
products and sorts CuPy has no bfloat16 for, uniform draws made on the GPU, and views of an array's
memory at a byte offset. CuPy 14.2 (seen on an H200) refuses bfloat16 in a batch of products, a sort
and cupyx.scatter_add; there the work runs in float32, which holds every bfloat16 exactly.
"""
import threading

import numpy as np

from . import switch
from .dtypes import bfloat16
from .switch import is_device_array


def _widened(a):
    return a.astype(np.float32) if a.dtype == bfloat16 else a


def scatter_add(out, indices, values):
    """out[indices] += values, adding where an index repeats (np.add.at / cupyx.scatter_add). bfloat16 on
    the GPU adds in float32 and rounds once (atomicAdd has no bfloat16)."""
    if not is_device_array(out):
        np.add.at(out, indices, values)
        return
    import cupyx
    if values.dtype != bfloat16:
        cupyx.scatter_add(out, indices, values)
        return
    wide = _widened(out)
    cupyx.scatter_add(wide, indices, values.astype(np.float32))
    if wide is not out:
        out[...] = wide.astype(out.dtype)


def matmul(a, b):
    """a @ b. A batch of bfloat16 products on the GPU (an operand of 3 or more dims; CuPy does float16's
    in float32 too) is computed in float32 and rounded once, as cuBLAS's bfloat16 GEMM accumulates."""
    if is_device_array(a) and max(a.ndim, b.ndim) > 2 and bfloat16 in (a.dtype, b.dtype):
        return (_widened(a) @ _widened(b)).astype(np.promote_types(a.dtype, b.dtype))
    return a @ b


def argsort(a, axis=-1):
    """The indices that sort ``a`` along ``axis``; bfloat16 on the GPU is sorted as float32 (the same order)."""
    return (_widened(a) if is_device_array(a) else a).argsort(axis=axis)


_rng = threading.local()   # .states: GPU index -> this thread's cuRAND Philox generator


def device_uniform(shape, seed, dtype):
    """Uniform [0, 1) numbers drawn on the GPU by cuRAND's Philox from ``seed`` (a counter-based
    generator: reseeding costs nothing, so every draw takes its seed from the host generator and
    recomputation replays it)."""
    cupy = switch._cupy
    states = getattr(_rng, "states", None)
    if states is None:
        states = _rng.states = {}
    state = states.get(switch._gpu)
    if state is None:
        state = states[switch._gpu] = cupy.random.RandomState(seed, method=cupy.cuda.curand.CURAND_RNG_PSEUDO_PHILOX4_32_10)
    else:
        state.seed(seed)
    return state.random_sample(shape, dtype=np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def address(a):
    """The address of ``a``'s first element (device pointers only through CuPy's MemoryPointer,
    never by converting the array)."""
    return a.data.ptr if is_device_array(a) else a.__array_interface__["data"][0]


def byte_offset(view, base):
    """Where ``view``'s first element lies in ``base``'s memory, in bytes."""
    return address(view) - address(base)


def view_of(base, shape, dtype, offset, strides):
    """The array of ``shape``/``strides`` at byte ``offset`` inside ``base``'s memory."""
    if is_device_array(base):
        return switch._cupy.ndarray(shape, dtype, memptr=base.data + offset, strides=strides)
    return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)

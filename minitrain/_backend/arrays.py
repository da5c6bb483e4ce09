"""What NumPy and CuPy arrays need spelled differently, written once: adding at repeated indices,
uniform draws made on the GPU, and views of an array's memory at a byte offset.
"""
import threading

import numpy as np

from . import switch
from .switch import is_device_array


def scatter_add(out, indices, values):
    """out[indices] += values, adding where an index repeats (np.add.at / cupyx.scatter_add)."""
    if is_device_array(out):
        import cupyx
        cupyx.scatter_add(out, indices, values)
    else:
        np.add.at(out, indices, values)


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

"""Explicit, replayable randomness: one seeded generator for parameter init and dropout.

manual_seed(s) makes a run reproducible; get_state() / set_state() let activation
recomputation replay dropout masks exactly. Numbers are drawn on the host with NumPy's PCG64
and moved to the device, so a CPU and a GPU run with the same seed see the same numbers (parameter
initialisation); dropout masks on the GPU are drawn there (device_uniform), from one host seed
per mask, so they replay and agree across ranks as well, but differ from the CPU's masks.

Each MPI process has its own generator, all starting from the same seed, so ranks that run the
same code draw the same numbers (tensor- and context-parallel ranks rely on it for dropout masks: rand_at
draws a rank's piece of a whole mask). ThreadWorld's
ranks are threads of one process: use_generator gives each thread its own generator, started
from a copy of the caller's state, so that threads behave as processes do.
"""
import contextlib
import itertools
import math
import threading

import numpy as np

from . import backend

_generator = np.random.Generator(np.random.PCG64(0))
_thread = threading.local()        # .generator: this thread's own generator (ThreadWorld ranks)


def generator():
    """The generator this thread draws from."""
    own = getattr(_thread, "generator", None)
    return _generator if own is None else own


def manual_seed(seed):
    """Reseed the generator (as ``torch.manual_seed``)."""
    global _generator
    fresh = np.random.Generator(np.random.PCG64(int(seed)))
    if getattr(_thread, "generator", None) is not None:
        _thread.generator = fresh
    else:
        _generator = fresh


def get_state():
    """A copy of the generator's state, for ``set_state`` later."""
    return generator().bit_generator.state


def set_state(state):
    generator().bit_generator.state = state


def fork():
    """A new generator in the current one's state (the current one is not advanced)."""
    copy = np.random.Generator(np.random.PCG64())
    copy.bit_generator.state = get_state()
    return copy


@contextlib.contextmanager
def use_generator(gen):
    """Draw from ``gen`` on this thread inside the block."""
    previous = getattr(_thread, "generator", None)
    _thread.generator = gen
    try:
        yield gen
    finally:
        _thread.generator = previous


def randn(*shape, dtype=None):
    dtype = dtype or backend.get_default_dtype()
    return backend.to_device(generator().standard_normal(shape).astype(dtype, copy=False))


def rand(*shape, dtype=None):
    dtype = dtype or backend.get_default_dtype()
    return backend.to_device(generator().random(shape).astype(dtype, copy=False))


def jump(state, steps):
    """Set the generator to ``state`` advanced by ``steps`` 64-bit draws (a float64 each), as drawing them would
    leave it (PCG64's ``advance``; the 32 bits it may hold back stay as they were, as a float64 draw leaves them)."""
    bits = generator().bit_generator
    bits.state = state
    bits.advance(int(steps))
    end = bits.state
    end["has_uint32"], end["uinteger"] = state["has_uint32"], state["uinteger"]
    bits.state = end


def rand_at(full_shape, index, dtype=None):
    """``rand(*full_shape)[index]`` drawing only those numbers, the generator left where the whole draw leaves
    it: the piece of one process's draw that a rank holding part of a tensor keeps (dropout under tensor, sequence
    and context parallelism). ``index`` holds one entry per leading axis, each a slice or an integer array, taken
    as an outer product (np.ix_). Each float64 is one 64-bit step of PCG64's stream, so the element at flat
    position n of the whole draw is n steps from the start: the generator jumps (``advance``) to each contiguous
    run of wanted elements. With many short runs (an expert's scattered rows) drawing the whole costs less."""
    dtype, full_shape = dtype or backend.get_default_dtype(), tuple(full_shape)
    picks = [np.arange(full_shape[k])[entry] for k, entry in enumerate(index)]      # each indexed axis's indices
    shape = tuple(len(pick) for pick in picks) + full_shape[len(picks):]
    if not picks:
        return rand(*full_shape, dtype=dtype)
    inner = math.prod(full_shape[len(picks):])                 # the whole axes after the indexed ones
    last = picks[-1]
    runs = np.split(last, np.flatnonzero(np.diff(last) != 1) + 1) if len(last) else []
    outer = list(itertools.product(*picks[:-1]))
    if len(outer) * len(runs) > 64 and len(last) < 4 * len(runs):
        return rand(*full_shape, dtype=dtype)[np.ix_(*picks)]
    gen = generator()
    start, pieces = gen.bit_generator.state, [np.empty(0)]
    for place in outer:
        first = np.ravel_multi_index(place, full_shape[:len(place)]) * full_shape[len(place)] if place else 0
        for run in runs:
            jump(start, (first + run[0]) * inner)
            pieces.append(gen.random(len(run) * inner))
    jump(start, math.prod(full_shape))
    return backend.to_device(np.concatenate(pieces).reshape(shape).astype(dtype, copy=False))


def device_uniform(*shape, dtype=None):
    """Uniform [0, 1) numbers drawn on the GPU (dropout masks): the host generator gives one seed
    (so ranks that share a seed draw the same numbers, and restoring the state replays the draw),
    cuRAND's Philox draws them where they are used, with no host-to-device copy."""
    seed = int(generator().integers(0, 2 ** 63 - 1))
    return backend.device_uniform(shape, seed, dtype or backend.get_default_dtype())


def uniform(low, high, shape, dtype=None):
    dtype = dtype or backend.get_default_dtype()
    return backend.to_device(generator().uniform(low, high, shape).astype(dtype, copy=False))

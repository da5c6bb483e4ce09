"""Explicit, replayable randomness: one seeded generator for parameter init and dropout.

``manual_seed(s)`` makes a run reproducible; ``get_state()`` / ``set_state()`` let activation
recomputation replay dropout masks exactly. Numbers are drawn on the host with NumPy's PCG64
and moved to the device, so a CPU and a GPU run with the same seed see the same numbers.
"""
import numpy as np

from . import backend

_generator = np.random.Generator(np.random.PCG64(0))


def manual_seed(seed):
    """Reseed the generator (as ``torch.manual_seed``)."""
    global _generator
    _generator = np.random.Generator(np.random.PCG64(int(seed)))


def get_state():
    """A copy of the generator's state, for ``set_state`` later."""
    return _generator.bit_generator.state


def set_state(state):
    _generator.bit_generator.state = state


def generator():
    return _generator


def randn(*shape, dtype=None):
    dtype = dtype or backend.get_default_dtype()
    return backend.to_device(_generator.standard_normal(shape).astype(dtype, copy=False))


def rand(*shape, dtype=None):
    dtype = dtype or backend.get_default_dtype()
    return backend.to_device(_generator.random(shape).astype(dtype, copy=False))


def uniform(low, high, shape, dtype=None):
    dtype = dtype or backend.get_default_dtype()
    return backend.to_device(_generator.uniform(low, high, shape).astype(dtype, copy=False))

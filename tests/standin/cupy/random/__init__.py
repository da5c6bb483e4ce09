"""``cupy.random`` of the stand-in: CuPy's two APIs (the legacy ``RandomState``, one per device,
behind the module functions; and ``Generator``/``default_rng``), drawing on the device: no
host-to-device copy is counted. The numbers come from NumPy's Philox, so they are reproducible
from the seed but are not cuRAND's (as CuPy's differ from NumPy's).
"""
import numpy as np

from .. import _standin as S
from .._core import new

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _float_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype not in _FLOATS:
        raise TypeError(f"cupy.random only supports float32 and float64, got {dtype}")
    return dtype


def _size(size):
    return () if size is None else size


class RandomState:
    """A generator on the current device (``method``: a cupy.cuda.curand generator kind)."""

    def __init__(self, seed=None, method=None):
        self.method = method
        self.seed(seed)

    def seed(self, seed=None):
        if seed is not None:
            seed = int(np.asarray(seed))
            if not 0 <= seed < 2 ** 64:
                raise ValueError("Seed must be an integer between 0 and 2**64 - 1")
        self._gen = np.random.Generator(np.random.Philox(seed))

    def _out(self, values, kernels=1):
        for _ in range(kernels):
            S.kernel("curand")
        return new(np.asarray(values))

    def random_sample(self, size=None, dtype=float):
        return self._out(self._gen.random(_size(size), dtype=_float_dtype(dtype)), kernels=2)

    random = random_sample

    def rand(self, *size, dtype=float):
        return self.random_sample(size, dtype)

    def uniform(self, low=0.0, high=1.0, size=None, dtype=float):
        dtype = _float_dtype(dtype)
        return self._out(self._gen.uniform(low, high, _size(size)).astype(dtype), kernels=2)

    def standard_normal(self, size=None, dtype=float):
        dtype = _float_dtype(dtype)
        return self._out(self._gen.standard_normal(_size(size), dtype=dtype))

    def normal(self, loc=0.0, scale=1.0, size=None, dtype=float):
        dtype = _float_dtype(dtype)
        return self._out(self._gen.normal(loc, scale, _size(size)).astype(dtype))

    def randn(self, *size, dtype=float):
        return self.normal(size=size, dtype=dtype)

    def randint(self, low, high=None, size=None, dtype=int):
        return self._out(self._gen.integers(low, high, _size(size), dtype=dtype))

    def permutation(self, a):
        return self._out(self._gen.permutation(a))


class _BitGenerator:
    def __init__(self, seed=None):
        self._gen = np.random.Generator(np.random.Philox(seed))


class XORWOW(_BitGenerator):
    pass


class MRG32k3a(_BitGenerator):
    pass


class Philox4x3210(_BitGenerator):
    pass


class Generator:
    """CuPy's new API (``cupy.random.default_rng(seed)``)."""

    def __init__(self, bit_generator):
        self.bit_generator = bit_generator
        self._gen = bit_generator._gen

    def random(self, size=None, dtype=np.float64, out=None):
        S.kernel("curand")
        values = self._gen.random(_size(size), dtype=_float_dtype(dtype))
        if out is not None:
            out._a[...] = values
            return out
        return new(np.asarray(values))

    def uniform(self, low=0.0, high=1.0, size=None, dtype=np.float64):
        S.kernel("curand")
        return new(np.asarray(self._gen.uniform(low, high, _size(size)).astype(_float_dtype(dtype))))

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        S.kernel("curand")
        return new(np.asarray(self._gen.integers(low, high, _size(size), dtype=dtype, endpoint=endpoint)))

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        S.kernel("curand")
        values = self._gen.standard_normal(_size(size), dtype=_float_dtype(dtype))
        if out is not None:
            out._a[...] = values
            return out
        return new(np.asarray(values))


def default_rng(seed=None):
    return Generator(XORWOW(seed))


_states = {}            # device id -> the RandomState behind the module functions


def get_random_state():
    device = S.current_device()
    if device not in _states:
        _states[device] = RandomState()
    return _states[device]


def set_random_state(rs):
    _states[S.current_device()] = rs


def reset_states():
    _states.clear()


def seed(seed=None):
    get_random_state().seed(seed)


def rand(*size, dtype=float):
    return get_random_state().rand(*size, dtype=dtype)


def randn(*size, dtype=float):
    return get_random_state().randn(*size, dtype=dtype)


def random_sample(size=None, dtype=float):
    return get_random_state().random_sample(size, dtype)


random = random_sample


def uniform(low=0.0, high=1.0, size=None, dtype=float):
    return get_random_state().uniform(low, high, size, dtype)


def normal(loc=0.0, scale=1.0, size=None, dtype=float):
    return get_random_state().normal(loc, scale, size, dtype)


def standard_normal(size=None, dtype=float):
    return get_random_state().standard_normal(size, dtype)


def randint(low, high=None, size=None, dtype=int):
    return get_random_state().randint(low, high, size, dtype)


def permutation(a):
    return get_random_state().permutation(a)

"""The methods of the stand-in's ``cupy.ndarray`` (CuPy 14's list): NumPy's, on device arrays.

A method that makes a new array is one kernel on the current device (the array must live there);
one that returns a view (reshape of a contiguous array, transpose, view) makes none and checks
nothing, as in CuPy. Inside a fused function only ``astype`` and ``copy`` are allowed.
"""
import numpy as np

from . import _standin as S
from ._core import _base_of, check_device, data_dependent_shape, new, unwrap, wrap_result
from ._functions import SORTS, refuse_unsortable

# CuPy 14.2's ndarray methods (cupy/_core/core.pyx), less the ones defined in _core.py
_GENERIC = ("all", "any", "argmax", "argmin", "argpartition", "argsort", "choose", "clip", "compress", "conj",
            "conjugate", "cumprod", "cumsum", "diagonal", "flatten", "max", "mean", "min", "nonzero", "partition",
            "prod", "ptp", "ravel", "repeat", "reshape", "round", "searchsorted", "sort", "squeeze", "std", "sum",
            "swapaxes", "take", "trace", "transpose", "var")


def _generic(name):
    def method(self, *args, **kwargs):
        if S.fusing():
            raise TypeError(f"ndarray.{name}() is not supported in cupy.fuse (use cupy.sum(x, axis=...) "
                            "and friends, without keepdims)")
        found = [self]
        if name in SORTS:
            refuse_unsortable(found)
        raw = [unwrap(a, found) for a in args]
        out = kwargs.get("out")
        raw_kwargs = {k: (v._a if isinstance(v, type(self)) else unwrap(v, found)) for k, v in kwargs.items()}
        if out is not None:
            found.append(out)
        if name in ("sort",):                          # in place
            check_device(found)
            self._a.sort(*raw, **raw_kwargs)
            S.kernel(name)
            return None
        if name in ("nonzero", "compress"):
            data_dependent_shape(name)
        with np.errstate(all="ignore"):
            r = getattr(self._a, name)(*raw, **raw_kwargs)
        if out is not None:
            check_device(found)
            S.kernel(name)
            return out
        return wrap_result(r, found, name)
    method.__name__ = name
    return method


def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
    dtype = np.dtype(dtype)
    if not copy and dtype == self.dtype:
        return self
    check_device([self])
    state = S.fusion_state()
    if state is not None:
        state.ufunc([self], ())
    r = new(self._a.astype(dtype, order=order))
    if state is not None:
        state.produced([self], (r,))
    S.kernel("astype")
    return r


def copy(self, order="C"):
    check_device([self])
    state = S.fusion_state()
    if state is not None:
        state.ufunc([self], ())
    r = new(self._a.copy(order=order))
    if state is not None:
        state.produced([self], (r,))
    S.kernel("copy")
    return r


def fill(self, value):
    if S.fusing():
        raise TypeError("ndarray.fill() is not supported in cupy.fuse")
    if isinstance(value, type(self)):
        if value.shape != ():
            raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
        check_device([self, value])
        value = value._a
    else:
        value = np.asarray(value, dtype=self.dtype)
        if value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        check_device([self])
    self._a.fill(value)
    S.kernel("fill")


def view(self, dtype=None, array_class=None):
    return new(self._a.view() if dtype is None else self._a.view(dtype), self._dev, _base_of(self))


def dot(self, b, out=None):
    import cupy
    return cupy.dot(self, b, out=out)


METHODS = {name: _generic(name) for name in _GENERIC}
METHODS.update(astype=astype, copy=copy, fill=fill, view=view, dot=dot)

"""``cupy.ufunc`` of the stand-in, and the array operators built on it: a NumPy ufunc that takes
device arrays and scalars only (a NumPy array or a list is refused with CuPy's TypeError), runs
on the current device (every array must live there) and counts one kernel launch."""
import numpy as np

from . import _core
from . import _standin as S

SCALAR_TYPES = (bool, int, float, complex, np.generic)
_MISSING = object()


class ufunc:
    """A NumPy ufunc that takes only device arrays and scalars (cupy.ufunc)."""

    def __init__(self, np_ufunc):
        self._u = np_ufunc
        self.__name__ = self.name = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __repr__(self):
        return f"<ufunc '{self.name}'>"

    def _args(self, args):
        arrays, raw = [], []
        for a in args:
            if isinstance(a, _core.ndarray):
                arrays.append(a)
                raw.append(a._a)
            elif isinstance(a, SCALAR_TYPES):
                raw.append(a)
            else:                              # a NumPy array, a list, anything else
                raise _core.unsupported(a)
        return arrays, raw

    def __call__(self, *args, out=None, **kwargs):
        if len(args) > self.nin:               # outputs given positionally
            args, out = args[:self.nin], args[self.nin:] if len(args) > self.nin + 1 else args[self.nin]
        arrays, raw = self._args(args)
        outs = () if out is None else (out if isinstance(out, tuple) else (out,))
        for o in outs:
            if not isinstance(o, _core.ndarray):
                raise TypeError(f"Output arrays must be cupy.ndarray, got {type(o)}")
        _core.check_device(arrays + list(outs))
        state = S.fusion_state()
        if state is not None:
            state.ufunc(arrays, outs)
        with np.errstate(all="ignore"):        # CuPy's kernels never warn
            if outs:
                self._u(*raw, out=tuple(o._a for o in outs) if len(outs) > 1 else outs[0]._a, **kwargs)
            else:
                r = self._u(*raw, **kwargs)
        S.kernel(self.name)
        if outs:
            return outs if len(outs) > 1 else outs[0]
        results = tuple(_core.new(np.asarray(x)) for x in r) if isinstance(r, tuple) else _core.new(np.asarray(r))
        if state is not None:
            state.produced(arrays, results if isinstance(results, tuple) else (results,))
        return results

    def _method(self, method, a, *args, **kwargs):
        if S.fusing():
            raise TypeError(f"{self.name}.{method} is not supported in cupy.fuse")
        found = []
        raw_a = _core.unwrap(a, found)
        raw_args = [_core.unwrap(x, found) for x in args]
        out = kwargs.get("out")
        if isinstance(out, _core.ndarray):
            found.append(out)
            kwargs["out"] = out._a
        _core.check_device(found)
        with np.errstate(all="ignore"):
            r = getattr(self._u, method)(raw_a, *raw_args, **kwargs)
        S.kernel(f"{self.name}.{method}")
        if method == "at":
            return None
        return out if isinstance(out, _core.ndarray) else _core.new(np.asarray(r))

    def reduce(self, a, *args, **kwargs):
        return self._method("reduce", a, *args, **kwargs)

    def accumulate(self, a, *args, **kwargs):
        return self._method("accumulate", a, *args, **kwargs)

    def outer(self, a, b, **kwargs):
        return self._method("outer", a, b, **kwargs)

    def at(self, a, indices, b=None):
        indices = _core._implicit_index(indices)
        return self._method("at", a, indices, *(() if b is None else (b,)))


UFUNCS = {name: ufunc(getattr(np, name)) for name in dir(np) if isinstance(getattr(np, name), np.ufunc)}


def _binary(name, reflected=False):
    u = UFUNCS[name]

    def op(self, other):
        if not (isinstance(other, (_core.ndarray, np.ndarray)) or isinstance(other, SCALAR_TYPES)):
            if getattr(other, "__array_ufunc__", _MISSING) is None:      # e.g. a minitrain Tensor
                return NotImplemented
            if getattr(other, "__array_priority__", 0) > _core.ndarray.__array_priority__:
                return NotImplemented
        return u(other, self) if reflected else u(self, other)
    return op


def _inplace(name):
    u = UFUNCS[name]

    def op(self, other):
        return u(self, other, out=self)
    return op



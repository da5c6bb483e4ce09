"""``cupy.fuse`` of the stand-in: the function runs eagerly on the stand-in's arrays and counts as
one kernel launch, and what CuPy's fusion cannot compile is refused while it runs (cupy/_core/
fusion.pyx at v14.2.0): only ufuncs, ``cupy.where``, ``astype``/``copy``, ``x[...] = y`` and in-place
operators, and at most one reduction (``cupy.sum``/``prod``/``amax``/``amin``, no ``keepdims``),
after which only the reduced values may be used (CuPy: "Shape mismatch"); no ``bool()`` of an
array, no indexing, no methods such as ``reshape``. Arguments: device arrays, Python and NumPy
scalars, None; a call without any device array runs the plain Python function, as CuPy does.
"""
import functools

import numpy as np

from . import _standin as S
from ._core import check_device, ndarray

_ACCEPTABLE = (ndarray, np.ndarray, np.generic, int, float, complex, bool, type(None))


class _State:
    """What the running fused function has done: its reduction, and the arrays computed from it."""

    def __init__(self):
        self.reduced = set()          # ids of arrays after the reduction (CuPy's "postmap")
        self.keep = []                # keeps those arrays alive, so that their ids stay theirs
        self.reductions = 0

    def ufunc(self, inputs, outs):
        kinds = {id(a) in self.reduced for a in inputs}
        kinds |= {id(o) in self.reduced for o in outs}
        if len(kinds) > 1:
            raise Exception("Shape mismatch")

    def produced(self, inputs, results):
        if any(id(a) in self.reduced for a in inputs):
            for r in results:
                self.reduced.add(id(r))
                self.keep.append(r)

    def reduction(self, inputs):
        if self.reductions or any(id(a) in self.reduced for a in inputs):
            raise NotImplementedError("Multiple reduction is not implemented yet")
        self.reductions += 1

    def produced_by_reduction(self, r):
        self.reduced.add(id(r))
        self.keep.append(r)


class Fusion:
    def __init__(self, func, name=None):
        self.func = func
        self.name = name or func.__name__

    def __repr__(self):
        return f"<Fusion '{self.name}'>"

    def __call__(self, *args):
        if S.fusing():                               # a fused function called inside another: inlined
            return self.func(*args)
        arrays = [a for a in args if isinstance(a, ndarray)]
        if not arrays:
            return self.func(*args)
        if not all(isinstance(a, _ACCEPTABLE) for a in args):
            raise TypeError(f"Invalid argument type for '{self.name}': ({', '.join(repr(type(a)) for a in args)})")
        check_device(arrays)
        state = _State()
        S.set_fusion_state(state)
        try:
            result = self.func(*args)
        finally:
            S.set_fusion_state(None)
        outputs = result if isinstance(result, tuple) else (result,)
        if result is not None and not all(isinstance(r, ndarray) or r is None for r in outputs):
            raise TypeError(f"Fusion function can't return {type(result)}")
        if state.reductions and any(isinstance(r, ndarray) and id(r) not in state.reduced for r in outputs):
            raise Exception("Shape mismatch")
        S.add("fused")
        S.kernel(f"fuse:{self.name}")
        return result


def fuse(*args, **kwargs):
    """Decorator: ``@cupy.fuse()`` or ``@cupy.fuse(kernel_name=...)`` or ``@cupy.fuse``."""
    def wrapper(f, kernel_name=None):
        return functools.update_wrapper(Fusion(f, kernel_name), f)
    if len(args) == 1 and not kwargs and callable(args[0]):
        return wrapper(args[0])
    return lambda f: wrapper(f, *args, **kwargs)

"""Watched NumPy arrays: a grader hands the learner arrays that note every numeric operation run on them
(a ufunc or a NumPy function, not a reshape, view or copy, whose result stays watched under the same name),
so that a check can say which half of an algorithm computed what (Watched.half, which the grader sets)."""
import numpy as np


class Watched(np.ndarray):
    """An array whose every numeric operation (not a reshape or copy) is noted: (half running, name, op)."""
    SHAPING = {"reshape", "ravel", "transpose", "swapaxes", "moveaxis", "copy", "ascontiguousarray", "asarray",
               "asanyarray", "shape", "ndim", "size", "result_type", "shares_memory", "may_share_memory"}
    seen, half = [], None

    def __array_finalize__(self, obj):
        self.name = getattr(obj, "name", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        op = ufunc.__name__ + ("" if method == "__call__" else "." + method)
        Watched.seen += [(Watched.half, name, op) for name in _names(inputs)]
        return getattr(ufunc, method)(*_plain(inputs), **_plain(kwargs))

    def __array_function__(self, func, types, args, kwargs):
        names = _names(args) + _names(kwargs.values())
        out = func(*_plain(args), **_plain(kwargs))
        if func.__name__ not in self.SHAPING:
            Watched.seen += [(Watched.half, name, f"np.{func.__name__}") for name in names]
        elif isinstance(out, np.ndarray) and names:     # a view or a copy of x is still x
            out = out.view(Watched)
            out.name = names[0]
        return out


def _names(values):
    return [n for v in values for n in (_names(v) if isinstance(v, (tuple, list)) else
                                         [v.name] if isinstance(v, Watched) else [])]


def _plain(v):
    if isinstance(v, (tuple, list, dict)):
        return {k: _plain(u) for k, u in v.items()} if isinstance(v, dict) else type(v)(_plain(u) for u in v)
    return v.view(np.ndarray) if isinstance(v, Watched) else v


def watch(a, name):
    w = np.array(a).view(Watched)
    w.name = name
    return w

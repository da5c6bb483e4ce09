"""Comparing the learner's arrays with the expected ones, and saying how they differ as a teacher
would: the first wrong element, how many, which chunk, "p times too large". The learner's code runs
where the device is (NumPy on the CPU, CuPy on the GPU); graders compare on the host.
"""
import numpy as np

from minitrain import backend
from .grading import Mismatch


def _fmt(x):
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.6g}"
    return repr(x.item() if hasattr(x, "item") else x)


def on_gpu():
    """True when the learner's code runs on the GPU (MINITRAIN_DEVICE=cuda, or backend.set_device)."""
    return backend.get_device() == "cuda"


def alias_problem(got, given, what, name):
    """An explanation when the learner returned ``given`` itself or a view of it where the contract asks
    for a new array (typically a shortcut at p = 1), else None: the caller keeps both and may change one."""
    same = got is given
    if not same and type(got) is type(given) and hasattr(got, "size") and got.size and given.size:
        share = getattr(backend.array_module(given), "shares_memory", None)
        same = share is not None and bool(share(got, given))
    if same:
        return (f"{what}: the result is {name} itself (or a view of it): return a NEW array, as the contract "
                f"says (the caller keeps {name} and may change one without the other)")
    return None


def to_learner(a):
    """A fresh copy of the host array ``a`` where the learner's code runs: on the GPU when the device
    is cuda (an explicit, counted host -> device copy), else on the host."""
    a = np.array(a)
    return backend.to_device(a) if on_gpu() else a


def host(a):
    """``a`` as a NumPy array, copied from the GPU on purpose (backend.to_host) when it lives there:
    graders compare on the host. A minitrain Tensor gives its array; None stays None."""
    if a is None:
        return None
    if hasattr(a, "data") and hasattr(a, "requires_grad"):          # a minitrain Tensor
        a = a.data
    return backend.to_host(a) if backend.is_device_array(a) else np.asarray(a)


def host_all(value):
    """``value`` with every array in it (in tuples, lists and dicts, at any depth) copied to the host
    by host(): what a program returned, ready to compare with NumPy."""
    if isinstance(value, (tuple, list)):
        return type(value)(host_all(v) for v in value)
    if isinstance(value, dict):
        return {k: host_all(v) for k, v in value.items()}
    if backend.is_device_array(value) or (hasattr(value, "data") and hasattr(value, "requires_grad")):
        return host(value)
    return value


def as_array(value, what):
    """The learner's return value as a host ndarray (copied from the GPU on purpose), or a Mismatch
    saying what came back instead: on the GPU, a NumPy array means the code left the device."""
    if backend.is_device_array(value):
        return backend.to_host(value)
    if isinstance(value, np.ndarray):
        if on_gpu():
            raise Mismatch(f"{what}: returned a NumPy array (host memory), but your inputs were on the GPU "
                           "(MINITRAIN_DEVICE=cuda): compute with the inputs' own array module, "
                           "xp = minitrain.backend.array_module(x), not np, and return the GPU's array")
        return value
    if hasattr(value, "numpy") and hasattr(value, "shape"):     # a minitrain or torch Tensor
        raise Mismatch(f"{what}: returned a {type(value).__name__}, expected " + kind_of_array()
                       + " (use .data for a minitrain Tensor's array)")
    raise Mismatch(f"{what}: returned {type(value).__name__} {value!r:.60}, expected {kind_of_array()}")


def kind_of_array():
    """What the contract's arrays are here: NumPy's on the CPU, CuPy's on the GPU."""
    return "a CuPy array (the inputs' module)" if on_gpu() else "a NumPy array"


def is_array(x):
    """True for an array of the kind the learner's code works with here (kind_of_array())."""
    return backend.is_device_array(x) if on_gpu() else isinstance(x, np.ndarray)


def compare(got, want, what, rtol=1e-10, atol=1e-12, exact=False, chunks=None, ranks=None):
    """None if ``got`` equals ``want`` (exactly, or to rtol/atol); else a teacher's explanation:
    shape or dtype, the first wrong element, how many are wrong, whether they sit in one chunk
    (``chunks`` = np.array_split count), and whether ``got`` is ``ranks`` times too large or small."""
    # a learner's raw return value is checked by as_array (on the GPU it must stay there); one already
    # copied to the host by as_array / unpack is compared as it is
    got = np.asarray(got) if isinstance(got, np.ndarray) else as_array(got, what)
    want = host(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, expected {want.shape}"
    if exact and got.dtype != want.dtype:
        return f"{what}: dtype {got.dtype}, expected {want.dtype}"
    g = got.astype(np.float64) if got.dtype.kind in "fiub" or got.dtype.name in ("bfloat16",) else got
    w = want.astype(np.float64) if want.dtype.kind in "fiub" or want.dtype.name in ("bfloat16",) else want
    if exact:
        wrong = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    else:
        wrong = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if not wrong.any():
        return None
    flat_wrong = np.flatnonzero(wrong.reshape(-1))
    first = int(flat_wrong[0])
    shown = tuple(int(i) for i in np.unravel_index(first, got.shape)) if got.ndim > 1 else first
    text = (f"{what}: element {shown} is {_fmt(g.reshape(-1)[first])}, expected {_fmt(w.reshape(-1)[first])} "
            f"({flat_wrong.size} of {got.size} elements wrong")
    if not np.isfinite(g).all() and np.isfinite(w).all():
        text += "; your result has inf or NaN"
    text += ")"
    if chunks and got.ndim == 1 and chunks > 1:
        bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(got.size), chunks)])
        bad = sorted({int(np.searchsorted(bounds, i, side="right") - 1) for i in flat_wrong})
        text += f"; wrong chunk(s) of np.array_split(..., {chunks}): {bad}"
    nonzero = w != 0
    if nonzero.any() and np.isfinite(g).all():
        ratios = g[nonzero] / w[nonzero]
        r = float(np.median(ratios))
        telling = ranks and (np.isclose(r, ranks) or np.isclose(r, 1.0 / ranks))
        if np.allclose(ratios, r, rtol=1e-6) and not np.isclose(r, 1.0) and (ratios.size > 1 or telling):
            text += f"; every element is {r:.4g} times the expected one"
            if ranks and np.isclose(r, ranks):
                text += f" = p ({ranks}): summed over the ranks where a mean was due, or summed twice?"
            elif ranks and np.isclose(r, 1.0 / ranks):
                text += f" = 1/p (p = {ranks}): averaged where a sum was due, or divided by p once too often?"
        elif np.allclose(g, 0.0):
            text += "; your result is all zeros"
    return text

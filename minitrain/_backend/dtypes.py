"""The floating dtypes: the default one of new tensors (float32, as in PyTorch; set_default_dtype
switches it), and the 16-bit ones mixed precision computes in (bfloat16 from ml_dtypes); what counts as an
integer and as a real number where an argument must be one (NumPy's scalars too, a bool never).
"""
import numbers

import numpy as np

try:                                   # bfloat16 for NumPy (the package JAX uses)
    from ml_dtypes import bfloat16
except ImportError:                    # pragma: no cover - ml_dtypes is a dependency
    bfloat16 = None

#: the 16-bit floating dtypes mixed precision computes in
LOW_PRECISION = tuple(np.dtype(d) for d in (np.float16, bfloat16) if d is not None)

_default_dtype = np.dtype(np.float32)


def set_default_dtype(dtype):
    """The floating dtype of new tensors and parameters (float32 unless changed)."""
    global _default_dtype
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"default dtype must be a floating type, got {dtype}")
    _default_dtype = dtype


def get_default_dtype():
    return _default_dtype


def is_int(value):
    """An integer, as torch takes a count or an index: Python's or NumPy's; a bool or 2.5 is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value):
    """A real number (an integer or a float, Python's or NumPy's; NaN and inf included); a bool is not one."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)

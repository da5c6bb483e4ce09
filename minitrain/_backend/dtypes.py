"""The floating dtypes: the default one of new tensors (float32, as in PyTorch; set_default_dtype
switches it), and the 16-bit ones mixed precision computes in (bfloat16 from ml_dtypes).
"""
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

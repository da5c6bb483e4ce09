"""The array module: NumPy on the CPU, CuPy on a CUDA GPU, behind one switch (as in needle).

Every tensor holds an ``xp`` array. Code never imports cupy outside this file; it asks
``array_module(a)`` for the module that owns an array, or ``xp()`` for the module of the current
device. ``MINITRAIN_DEVICE=cuda`` (or ``minitrain.set_device("cuda")``) selects CuPy.
The default floating dtype is float32, as in PyTorch; ``set_default_dtype(np.float64)`` switches
it (the oracle tests run in float64).
"""
import os

import numpy as np

try:                                   # bfloat16 for NumPy (the package JAX uses)
    from ml_dtypes import bfloat16
except ImportError:                    # pragma: no cover - ml_dtypes is a dependency
    bfloat16 = None

#: the 16-bit floating dtypes mixed precision computes in
LOW_PRECISION = tuple(np.dtype(d) for d in (np.float16, bfloat16) if d is not None)

_cupy = None          # the cupy module, once imported
_device = "cpu"
_default_dtype = np.dtype(np.float32)


def _import_cupy():
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("device 'cuda' needs CuPy: pip install -e '.[gpu]'") from e
        _cupy = cupy
    return _cupy


def set_device(name):
    """Select where new tensors live: 'cpu' (NumPy) or 'cuda' (CuPy)."""
    global _device
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: expected 'cpu' or 'cuda'")
    if name == "cuda":
        _import_cupy()
    _device = name


def get_device():
    return _device


def cuda_available():
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        cupy = _import_cupy()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def xp():
    """The array module of the current device."""
    return _cupy if _device == "cuda" else np


def array_module(a):
    """The array module (numpy or cupy) that owns array ``a``."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy
    return np


def is_device_array(a):
    return _cupy is not None and isinstance(a, _cupy.ndarray)


def to_host(a):
    """A NumPy copy (or the array itself, if it already is one)."""
    if is_device_array(a):
        return _cupy.asnumpy(a)
    return np.asarray(a)


def to_device(a, device=None):
    """``a`` on ``device`` (default: the current one)."""
    device = device or _device
    if device == "cuda":
        return _import_cupy().asarray(a)
    return to_host(a)


def synchronize():
    """Wait for queued GPU work (a no-op on the CPU). Call before timing or before MPI reads a buffer."""
    if _cupy is not None and _device == "cuda":
        _cupy.cuda.get_current_stream().synchronize()


def scatter_add(out, indices, values):
    """out[indices] += values, adding where an index repeats (np.add.at / cupyx.scatter_add)."""
    if is_device_array(out):
        import cupyx
        cupyx.scatter_add(out, indices, values)
    else:
        np.add.at(out, indices, values)


def local_rank_count():
    """How many ranks the MPI launcher put on this machine (1 when not launched by one)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if var in os.environ:
            return max(1, int(os.environ[var]))
    return 1


def limit_blas_threads(threads=None):
    """Cap BLAS/OpenMP threads in this process (default: cores / ranks on this machine).
    Ranks that each start one BLAS thread per core fight over the cores: measured here, 4 ranks on
    2 cores made a digits-MLP run 30x slower until each rank kept to its share."""
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // local_rank_count())
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=threads)


def set_default_dtype(dtype):
    """The floating dtype of new tensors and parameters (float32 unless changed)."""
    global _default_dtype
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"default dtype must be a floating type, got {dtype}")
    _default_dtype = dtype


def get_default_dtype():
    return _default_dtype


if os.environ.get("MINITRAIN_DEVICE"):
    set_device(os.environ["MINITRAIN_DEVICE"])

"""A strict stand-in for CuPy 14.2, backed by NumPy: the tests' GPU without a GPU.

Put ``tests/standin`` first on the path (``PYTHONPATH=tests/standin``) and ``import cupy`` gets this.
It enforces CuPy's rules (checked against cupy/cupy at v14.2.0), with CuPy's exceptions and messages:

* no implicit conversion to NumPy: ``np.asarray(x)`` and ``x.__array__()`` raise TypeError
  ("Implicit conversion to a NumPy array is not allowed..."); there is no ``__array_interface__``
  (AttributeError, as CuPy has none) and no buffer protocol (TypeError);
* no NumPy array in a device operation: ``x + np_array``, ``np_array * x``, ``cupy.where(np_mask,
  ...)``, ``np.concatenate([x, np_array])``, ``x[...] = np_array`` (non-scalar) raise TypeError
  ("Unsupported type <class 'numpy.ndarray'>") or CuPy's ValueError for the assignment; NumPy's
  functions and ufuncs on device arrays dispatch to cupy (``__array_function__`` /
  ``__array_ufunc__``), as in CuPy; Python and NumPy scalars mix freely;
* device pointers only through ``__cuda_array_interface__`` (and ``x.data.ptr``); no DLPack export;
* devices: ``getDeviceCount()`` = CUPY_STANDIN_DEVICES (default 4); the current device is per
  host thread (a new thread starts on device 0); an array remembers its device, and a kernel
  that touches an array of another device raises CuPy's ValueError ("The device where the array
  resides (1) is different from the current device (0). Peer access is unavailable...");
* host <-> device moves only on purpose: ``cupy.asarray``/``cupy.array`` of host data, ``x.set``
  (host to device), ``x.get``, ``cupy.asnumpy``, ``x.item()``, ``float/int/bool(x)``, printing
  (device to host, blocking: each also a synchronisation);
* what CuPy converts silently (NumPy or list index arrays, NumPy values in an advanced
  assignment) is counted (``h2d_implicit``), or refused with CUPY_STANDIN_IMPLICIT=error;
* streams, events (record / synchronize / ``get_elapsed_time``), pinned memory
  (``cupy.cuda.alloc_pinned_memory``, ``cupyx.empty_pinned``), CUDA IPC handles that raise
  ``CUDARuntimeError`` cudaErrorNotSupported, ``cupy.random`` (RandomState per device, Generator),
  ``cupy.fuse`` (one kernel; refuses what CuPy's fusion cannot compile), ``cupyx.scatter_add``,
  bfloat16 through ml_dtypes (as CuPy 14.2 accepts it, refused where it refuses it: a batch of
  products, sorts, ``cupyx.scatter_add``). ElementwiseKernel / RawKernel need a CUDA
  compiler: they raise NotImplementedError here.

Counters (``cupy._standin.counters()``, ``cupy._standin.counting()``): h2d, d2h (and bytes),
h2d_implicit, sync, kernels (per name), fused, device_pointers, pinned_bytes; see _standin.py.
"""
import numpy as _np

from . import _standin
from ._core import ndarray
from ._ufunc import ufunc
from ._functions import build_namespace as _build_namespace
from ._fusion import fuse
from ._methods import METHODS as _METHODS
from . import cuda

__version__ = "14.2.0"
__standin__ = True

for _name, _fn in _METHODS.items():
    setattr(ndarray, _name, _fn)
globals().update(_build_namespace())

# dtypes and constants are NumPy's, as in CuPy
for _name in ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
              "float32", "float64", "complex64", "complex128", "intp", "dtype", "finfo", "iinfo", "pi", "e",
              "inf", "nan", "newaxis", "generic", "number", "integer", "floating", "signedinteger",
              "unsignedinteger", "inexact", "complexfloating", "promote_types", "result_type", "can_cast",
              "isscalar", "issubdtype"):
    globals()[_name] = getattr(_np, _name)
bool = _np.bool_    # noqa: A001  (cupy.bool, as numpy 2's)


def __getattr__(name):
    if name == "random":                     # imported on first use, as CuPy does (cuRAND)
        import importlib
        return importlib.import_module("cupy.random")
    raise AttributeError(f"module 'cupy' has no attribute '{name}'")


class _NeedsCompiler:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: the CuPy stand-in cannot compile CUDA C; "
                                  "write the kernel with cupy.fuse (a Python function) instead")


class ElementwiseKernel(_NeedsCompiler):
    pass


class ReductionKernel(_NeedsCompiler):
    pass


class RawKernel(_NeedsCompiler):
    pass


class _Pool:
    """The memory pools: only freeing is modelled (the stand-in keeps no pool)."""

    def free_all_blocks(self, stream=None):
        pass


_pool, _pinned_pool = _Pool(), _Pool()


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pinned_pool


def is_available():
    return cuda.is_available()

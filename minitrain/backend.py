"""The array module: NumPy on the CPU, CuPy on a CUDA GPU, behind one switch (as in needle).

Every tensor holds an xp array. Code never imports cupy outside this file and _backend/; it asks
array_module(a) for the module that owns an array, or xp() for the module of the current
device. MINITRAIN_DEVICE=cuda (or minitrain.set_device("cuda")) selects CuPy;
use_gpu(i) picks the GPU (minitrain.comm.init() gives rank r its local rank's).
Moves between host and device happen only here, on purpose, and are counted (transfer_counts):
host -> device copies, device -> host copies, and synchronisations (the host waiting for the GPU).
The default floating dtype is float32, as in PyTorch; set_default_dtype(np.float64) switches it.

Every name is used as backend.X. Each idea lives in its own module of _backend/ (switch: which
array module and which GPU; moves: the counted copies; arrays: what NumPy and CuPy spell
differently; host: launch and local rank, BLAS threads, held host memory; dtypes), re-exported here. This file
keeps the fused kernels' machinery, whose switch backend.FUSE is read here at each call.
"""
import os
import sys

from ._backend import switch
from ._backend.dtypes import bfloat16, LOW_PRECISION, set_default_dtype, get_default_dtype, is_int, is_real
from ._backend.switch import (_import_cupy, set_device, get_device, cuda_available, gpu_count, use_gpu,
                              bind_thread, gpu_index, describe_device, xp, array_module, is_device_array)
from ._backend.moves import (transfer_counts, to_host, to_device, to_host_into, to_device_into, to_scalar,
                             synchronize, record_event, elapsed_ms)
from ._backend.arrays import scatter_add, matmul, argsort, device_uniform, address, byte_offset, view_of
from ._backend.host import (launch_info, local_rank, local_rank_count, usable_cores, BLAS_THREAD_VARS, default_blas_threads,
                            limit_blas_threads, HELD_ARRAY_BYTES, hold_host_memory, blas_threads)

__all__ = ["bfloat16", "LOW_PRECISION", "set_default_dtype", "get_default_dtype", "is_int", "is_real",
           "_import_cupy", "set_device", "get_device", "cuda_available", "gpu_count", "use_gpu",
           "bind_thread", "gpu_index", "describe_device", "xp", "array_module", "is_device_array",
           "transfer_counts", "to_host", "to_device", "to_host_into", "to_device_into", "to_scalar",
           "synchronize", "record_event", "elapsed_ms",
           "scatter_add", "matmul", "argsort", "device_uniform", "address", "byte_offset", "view_of",
           "launch_info", "local_rank", "local_rank_count", "usable_cores", "BLAS_THREAD_VARS", "default_blas_threads",
           "limit_blas_threads", "HELD_ARRAY_BYTES", "hold_host_memory", "blas_threads",
           "FUSE", "FUSED", "fuse", "elementwise_kernel"]


# ---------------------------------------------------------------- fused kernels
#: fused kernels on (MINITRAIN_FUSE=0: every fused function runs as its separate operations, to
#: measure what fusion saves)
FUSE = os.environ.get("MINITRAIN_FUSE", "1") != "0"


class _Fused:
    """``cupy.fuse`` of ``make(cupy)``: one kernel per call. Should CuPy fail to compile it for some
    argument types (its fusion knows fewer dtypes than its ufuncs), the same function runs unfused
    (one kernel per operation) and that is said once on stderr."""

    def __init__(self, make, name):
        self.make, self.name = make, name
        self.fused = self.plain = None
        self.unfusable = set()
        FUSED.append(self)

    def __call__(self, *args):
        if self.fused is None:
            cupy = switch._import_cupy()
            self.plain = self.make(cupy)
            self.fused = cupy.fuse(kernel_name=self.name)(self.plain)
        key = tuple((a.dtype.str, a.ndim) if hasattr(a, "ndim") else type(a) for a in args)
        if FUSE and key not in self.unfusable:
            try:
                return self.fused(*args)
            except Exception as e:
                if getattr(switch._cupy, "__standin__", False):      # the stand-in ran it eagerly: a real bug
                    raise
                self.unfusable.add(key)
                sys.stderr.write(f"minitrain: cupy.fuse could not compile {self.name} for {key} "
                                 f"({type(e).__name__}: {e}); running it unfused\n")
        return self.plain(*args)


#: every fused kernel made so far (``unfusable``: the argument types CuPy could not compile it for)
FUSED = []


def fuse(make, name):
    """A fused elementwise kernel for device arrays: ``make(xp)`` returns a function of arrays and
    Python scalars written with xp's ufuncs (what cupy.fuse compiles)."""
    return _Fused(make, name)


class _ElementwiseKernel(_Fused):
    """One ``cupy.ElementwiseKernel`` written in CUDA C (``in_params``, ``out_params``, ``operation``)
    for updates in place, whose arguments are the kernel's (inputs, then the arrays it updates). The
    CuPy stand-in cannot compile C: there, and with MINITRAIN_FUSE=0, ``make(xp)`` (the same update
    in xp's ufuncs) runs instead, through cupy.fuse as the other kernels do, so CI checks the
    arithmetic and the GPU test checks that the C says the same (tests/test_gpu.py)."""

    def __init__(self, make, name, in_params, out_params, operation):
        super().__init__(make, name)
        self.spec = (in_params, out_params, operation)
        self.kernel = None

    def __call__(self, *args):
        if not FUSE or getattr(switch._import_cupy(), "__standin__", False):
            return super().__call__(*args)
        key = ("C",) + tuple(a.dtype.str for a in args if hasattr(a, "dtype"))
        if key not in self.unfusable:
            try:
                if self.kernel is None:
                    self.kernel = switch._cupy.ElementwiseKernel(*self.spec, name=self.name)
                return self.kernel(*args)
            except Exception as e:          # e.g. a dtype CUDA C has no sqrt for: say so, run the ufuncs
                self.unfusable.add(key)
                sys.stderr.write(f"minitrain: ElementwiseKernel {self.name} failed for {key[1:]} "
                                 f"({type(e).__name__}: {e}); running it through cupy.fuse\n")
        return super().__call__(*args)


def elementwise_kernel(make, name, in_params, out_params, operation):
    """An in-place elementwise update as one CUDA kernel (see _ElementwiseKernel)."""
    return _ElementwiseKernel(make, name, in_params, out_params, operation)

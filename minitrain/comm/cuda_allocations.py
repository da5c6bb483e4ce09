"""Which cudaMalloc allocation a device pointer lies in: (base, size, id), what a CUDA IPC handle names
(cudaIpcGetMemHandle wants an allocation's base; ipc.py exports the allocation and sends the offset).
The driver's cuPointerGetAttributes through ctypes; the tests' CuPy stand-in answers for itself.
"""
import ctypes

from .. import backend

# CUDA driver API, cuda.h: CUpointer_attribute
CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE = 7, 11, 12


class _Driver:
    """cuPointerGetAttributes through ctypes (CuPy 14.2 does not wrap it; PyTorch's CUDA IPC asks its
    caching allocator for the same (base, size) of the allocation a pointer lies in)."""

    fn = None

    @classmethod
    def allocation(cls, ptr):
        if cls.fn is None:
            fn = ctypes.CDLL("libcuda.so.1").cuPointerGetAttributes
            fn.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
            fn.restype = ctypes.c_int
            cls.fn = fn
        base, size, buffer_id = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64()
        attrs = (ctypes.c_int * 3)(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                   CU_POINTER_ATTRIBUTE_BUFFER_ID)
        data = (ctypes.c_void_p * 3)(ctypes.addressof(base), ctypes.addressof(size), ctypes.addressof(buffer_id))
        status = cls.fn(3, attrs, data, ptr)
        if status != 0:
            raise RuntimeError(f"cuPointerGetAttributes({ptr:#x}) failed: CUresult {status}")
        return base.value, size.value, buffer_id.value


def allocation_range(ptr):
    """(base, size, id) of the cudaMalloc'ed allocation holding device pointer ``ptr`` (the id is
    unique for the process's lifetime, so a cache keyed by it is never stale). A wrong answer fails here."""
    cupy = backend._import_cupy()
    if getattr(cupy, "__standin__", False):
        found = cupy._standin.allocation_range(ptr)
        if found is None:
            raise RuntimeError(f"pointer {ptr:#x} is in no exportable allocation")
    else:
        found = _Driver.allocation(ptr)
    base, size, buffer_id = found
    if not base <= ptr < base + max(size, 1):
        raise RuntimeError(f"allocation_range({ptr:#x}) answered base {base:#x}, size {size}: not around the pointer")
    return base, size, buffer_id

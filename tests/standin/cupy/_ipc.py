"""CUDA IPC for the stand-in (CUPY_STANDIN_IPC=1): device memory that other processes can map.

A real GPU's memory is one address space that another process on the node maps with
``cudaIpcOpenMemHandle``; the stand-in's "device memory" is NumPy memory, private to its process.
With CUPY_STANDIN_IPC=1 every new device array is placed in shared memory instead: files in
/dev/shm, each mapped into the process and carved into blocks (free lists by power-of-two size
class), as CuPy's memory pool carves its cudaMalloc'ed regions. One file plays one cudaMalloc
allocation: ``allocation_range(ptr)`` gives its (base, size, id) as the driver's
cuPointerGetAttributes does, ``ipcGetMemHandle`` names it in 64 bytes, and ``ipcOpenMemHandle`` in
another process maps the same file, so that process reads (and writes) the very same bytes. A
handle opened twice returns the same pointer (CUDA counts references); the exporting process may
not open its own handle. Interprocess events are names too; work is eager here, so waiting on one
is only checked, never needed. Files of dead processes are removed when an arena starts.
"""
import atexit
import ctypes
import mmap
import os
import secrets
import struct
import tempfile
import threading
import weakref

import numpy as np

from . import _standin as S

CHUNK_BYTES = 64 << 20          # one "cudaMalloc" region (a sparse file: only touched pages cost)
MIN_BLOCK = 256                 # CuPy's pool rounds to 512-byte units; any small class will do
PREFIX = "cupy-standin-ipc-"
_MEM, _EVT = b"SIPC", b"SEVT"
_HANDLE = struct.Struct("<4sIQQQ")          # magic, pid, token, region id, region size (+ zero padding)


def _directory():
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _address(buffer):
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _remove_stale_files(directory):
    """Files left by processes that no longer run (a killed test) are deleted."""
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass


class _Region:
    """One shared file mapped into this process: the stand-in's cudaMalloc'ed region."""

    def __init__(self, path, size, region_id, create):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size, self.id = path, size, region_id
        self.base = _address(self.map)


class Arena:
    """This process's shared device memory: regions and their free blocks."""

    def __init__(self):
        self.directory = _directory()
        _remove_stale_files(self.directory)
        self.token = secrets.randbits(48)
        self.regions = []                   # in creation order; region id = index + 1
        self.free = {}                      # block size -> [(region, offset)]
        self.bump = None                    # (region, next free offset) of the newest shared region
        self.lock = threading.Lock()
        atexit.register(self.unlink_all)

    def _new_region(self, size):
        region_id = len(self.regions) + 1
        path = os.path.join(self.directory, f"{PREFIX}{os.getpid()}-{self.token:012x}-{region_id}")
        region = _Region(path, size, region_id, create=True)
        self.regions.append(region)
        return region

    def _block(self, nbytes):
        size = max(MIN_BLOCK, 1 << max(0, nbytes - 1).bit_length())
        with self.lock:
            blocks = self.free.get(size)
            if blocks:
                return (*blocks.pop(), size)
            if size > CHUNK_BYTES:                        # a large array: its own region
                return self._new_region(size), 0, size
            if self.bump is None or self.bump[1] + size > CHUNK_BYTES:
                self.bump = (self._new_region(CHUNK_BYTES), 0)
            region, offset = self.bump
            self.bump = (region, offset + size)
            return region, offset, size

    def _give_back(self, region, offset, size):
        with self.lock:
            self.free.setdefault(size, []).append((region, offset))

    def empty(self, shape, dtype, order="C"):
        """A NumPy array of ``shape``/``dtype`` in shared memory (freed when it is collected)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        region, offset, size = self._block(count * dtype.itemsize)
        a = np.ndarray(shape, dtype, buffer=region.map, offset=offset, order=order)
        weakref.finalize(a, self._give_back, region, offset, size)
        return a

    def copy_of(self, a):
        """``a`` moved into shared memory (its layout kept when it is contiguous)."""
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        out = self.empty(a.shape, a.dtype, order)
        out[...] = a
        return out

    def region_of(self, ptr):
        for region in self.regions:
            if region.base <= ptr < region.base + region.size:
                return region
        return None

    def unlink_all(self):
        for region in self.regions:
            try:
                os.unlink(region.path)
            except OSError:
                pass


_arena = None
_arena_lock = threading.Lock()


def arena():
    global _arena
    if _arena is None:
        with _arena_lock:
            if _arena is None:
                _arena = Arena()
    return _arena


def shared_array(a):
    """A fresh device array's memory: ``a`` itself, or (IPC emulation on) a shared copy of it."""
    return arena().copy_of(a) if S.IPC else a


def shared_empty(shape, dtype, order="C"):
    return arena().empty(shape, dtype, order) if S.IPC else np.empty(shape, dtype, order=order)


# ---------------------------------------------------------------- what the driver / runtime answer
def allocation_range(ptr):
    """(base, size, id) of the region holding device pointer ``ptr``, as the CUDA driver's
    cuPointerGetAttributes(RANGE_START_ADDR, RANGE_SIZE, BUFFER_ID) answers; None if the pointer
    lies in no region. Without IPC emulation the memory is private NumPy memory whose extent is
    not tracked: (ptr, 1, 0) (exporting it fails anyway, with cudaErrorNotSupported)."""
    if not S.IPC:
        return ptr, 1, 0
    region = arena().region_of(ptr)
    if region is None:
        opened = _opened_region_of(ptr)
        if opened is None:
            return None
        region = opened
    return region.base, region.size, region.id


def get_mem_handle(ptr):
    region = arena().region_of(ptr)
    if region is None or region.base != ptr:
        return None                      # not the base of an exportable allocation
    return _HANDLE.pack(_MEM, os.getpid(), arena().token, region.id, region.size).ljust(64, b"\0")


_opened = {}                              # path -> [region, references]
_opened_lock = threading.Lock()


def _opened_region_of(ptr):
    with _opened_lock:
        for region, _ in _opened.values():
            if region.base <= ptr < region.base + region.size:
                return region
    return None


def open_mem_handle(handle):
    """The base address of the region a handle names, mapped into this process (or an error name)."""
    magic, pid, token, region_id, size = _HANDLE.unpack(bytes(handle)[:_HANDLE.size])
    if magic != _MEM:
        return "invalid"
    if pid == os.getpid():
        return "own"
    path = os.path.join(_directory(), f"{PREFIX}{pid}-{token:012x}-{region_id}")
    with _opened_lock:
        entry = _opened.get(path)
        if entry is None:
            try:
                entry = _opened[path] = [_Region(path, size, region_id, create=False), 0]
            except FileNotFoundError:
                return "invalid"
        entry[1] += 1
    S.add("ipc_opens")
    return entry[0].base


def close_mem_handle(ptr):
    with _opened_lock:
        for entry in _opened.values():
            if entry[0].base == ptr and entry[1] > 0:
                entry[1] -= 1            # the mapping stays: arrays made over it may still be alive
                return True
    return False


# ---------------------------------------------------------------- interprocess events
_events = weakref.WeakValueDictionary()  # ptr -> local Event (interprocess ones can be exported)
_opened_events = set()                   # ptrs returned by ipcOpenEventHandle
_next_event = [1 << 40]


def register_event(event):
    _events[event.ptr] = event


def get_event_handle(ptr):
    event = _events.get(ptr)
    if event is None or not event.interprocess:
        return None
    return struct.pack("<4sIQ", _EVT, os.getpid(), ptr).ljust(64, b"\0")


def open_event_handle(handle):
    magic, pid, ptr = struct.unpack("<4sIQ", bytes(handle)[:16])
    if magic != _EVT:
        return "invalid"
    if pid == os.getpid():
        return "own"
    with _opened_lock:
        _next_event[0] += 1
        _opened_events.add(_next_event[0])
        return _next_event[0]


def known_event(ptr):
    return ptr in _events or ptr in _opened_events

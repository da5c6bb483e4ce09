"""``cupy.cuda`` of the stand-in: devices (the current one per host thread), streams, events,
device memory pointers and pinned host memory. Work runs eagerly on the host, so a stream is
bookkeeping, ``synchronize()`` is counted, and an event records the host clock (so
``get_elapsed_time`` measures the work between two records, as it would on a device).
``cupy.cuda.nccl`` (nccl.py) is what CuPy has on a machine without NCCL (``available`` False) unless
CUPY_STANDIN_NCCL=1 makes it NCCL for ranks that are threads of this process.
"""
import contextlib
import ctypes
import threading
import time

import numpy as np

from .. import _standin as S
from . import curand, runtime  # noqa: F401  (cupy.cuda.runtime, cupy.cuda.curand)
from .runtime import CUDARuntimeError


def is_available():
    return S.DEVICE_COUNT > 0


def get_device_id():
    return S.current_device()


class Device:
    """``Device(i).use()`` makes device i current for this host thread; ``with Device(i):`` for a block."""

    def __init__(self, device=None):
        self.id = S.current_device() if device is None else int(device)
        self._previous = []

    def use(self):
        runtime.setDevice(self.id)

    def __enter__(self):
        self._previous.append(S.current_device())
        self.use()
        return self

    def __exit__(self, *exc):
        S.set_current_device(self._previous.pop())
        return False

    def synchronize(self):
        S.add("sync")

    @property
    def compute_capability(self):
        return "90"

    @property
    def mem_info(self):
        return runtime.memGetInfo()

    def __int__(self):
        return self.id

    def __index__(self):
        return self.id

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


# ---------------------------------------------------------------- streams and events
_current = threading.local()     # .streams: device id -> the stream made current by `with stream:`


class Stream:
    null = None                  # set below: the default stream

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.device_id = S.current_device()
        self.ptr = 0 if null else id(self)
        self.non_blocking = non_blocking
        self._previous = []

    def synchronize(self):
        S.add("sync")

    @property
    def done(self):
        return True

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        pass

    def use(self):
        _streams()[S.current_device()] = self
        return self

    def __enter__(self):
        self._previous.append(_streams().get(S.current_device()))
        return self.use()

    def __exit__(self, *exc):
        previous = self._previous.pop()
        if previous is None:
            _streams().pop(S.current_device(), None)
        else:
            _streams()[S.current_device()] = previous
        return False

    def __repr__(self):
        return f"<Stream {self.ptr} (device {self.device_id})>"


Stream.null = Stream(null=True)


def _streams():
    streams = getattr(_current, "streams", None)
    if streams is None:
        streams = _current.streams = {}
    return streams


def get_current_stream(device_id=None):
    return _streams().get(S.current_device() if device_id is None else device_id, Stream.null)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:          # CuPy 14.2, cupy/cuda/stream.pyx
            raise ValueError("Timing must be disabled for interprocess events")
        self.disable_timing, self.interprocess = disable_timing, interprocess
        self.ptr = id(self)
        self._time = None
        from .. import _ipc
        _ipc.register_event(self)

    def record(self, stream=None):
        self._time = time.perf_counter()

    def synchronize(self):
        S.add("sync")

    @property
    def done(self):
        return True


def get_elapsed_time(start_event, end_event):
    """Milliseconds between two recorded events."""
    for e in (start_event, end_event):
        if e.disable_timing or e._time is None:
            raise CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
    return (end_event._time - start_event._time) * 1e3


# ---------------------------------------------------------------- memory
class Memory:
    """One device allocation (here: the NumPy array that holds it)."""

    def __init__(self, buffer, device_id):
        self.buffer, self.device_id = buffer, device_id
        self.ptr = buffer.__array_interface__["data"][0]
        self.size = buffer.nbytes


class UnownedMemory(Memory):
    """Device memory CuPy does not own, e.g. a peer's buffer opened with ipcOpenMemHandle:
    ``size`` bytes at ``ptr``, kept alive by ``owner``; ``device_id`` -1 asks the pointer's device."""

    def __init__(self, ptr, size, owner, device_id=-1):
        if ptr == 0 and device_id < 0:
            raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
        buffer = np.ctypeslib.as_array((ctypes.c_uint8 * max(int(size), 1)).from_address(int(ptr)))[:int(size)]
        super().__init__(buffer, S.current_device() if device_id < 0 else int(device_id))
        self.ptr, self._owner = int(ptr), owner


class MemoryPointer:
    """A pointer into device memory: ``mem`` + ``offset``; ``ptr`` is the address."""

    def __init__(self, mem, offset):
        self.mem, self.offset = mem, offset
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    @property
    def device(self):
        return Device(self.device_id)

    def __add__(self, offset):
        return MemoryPointer(self.mem, self.offset + offset)

    def __int__(self):
        return self.ptr


class PinnedMemoryPointer(bytearray):
    """Page-locked host memory (``np.frombuffer(p, dtype, count)`` views it, as with CuPy's)."""

    def __init__(self, size):
        super().__init__(size)
        self.size = size
        self.ptr = ctypes.addressof((ctypes.c_char * max(size, 1)).from_buffer(self)) if size else 0
        self.mem = self


def alloc_pinned_memory(size):
    S.add("pinned_bytes", size)
    return PinnedMemoryPointer(size)


@contextlib.contextmanager
def using_allocator(allocator=None):
    yield

"""Every move between host and device, on purpose, and counted (transfer_counts): host -> device
copies, device -> host copies, and synchronisations (the host waiting for the GPU, also when it
times the GPU with events).
"""
import threading

import numpy as np

from . import switch
from .switch import is_device_array


class _Counts(threading.local):
    def __init__(self):
        self.h2d = self.h2d_bytes = self.d2h = self.d2h_bytes = self.sync = 0


_counts = _Counts()


def transfer_counts():
    """This thread's deliberate moves so far: h2d / d2h (copies and bytes) and sync."""
    c = _counts
    return {"h2d": c.h2d, "h2d_bytes": c.h2d_bytes, "d2h": c.d2h, "d2h_bytes": c.d2h_bytes, "sync": c.sync}


def to_host(a):
    """A NumPy copy of a device array (counted: a blocking copy, so also a synchronisation);
    a host array itself."""
    if is_device_array(a):
        _counts.d2h += 1
        _counts.d2h_bytes += a.nbytes
        _counts.sync += 1
        return switch._cupy.asnumpy(a)
    return np.asarray(a)


def to_device(a, device=None):
    """``a`` on ``device`` (default: the current one); a host -> device copy is counted."""
    device = device or switch._device
    if device == "cuda":
        if not is_device_array(a):
            a = np.asarray(a)
            _counts.h2d += 1
            _counts.h2d_bytes += a.nbytes
        return switch._import_cupy().asarray(a)
    return to_host(a)


def to_host_into(a, out, blocking=True):
    """Copy device array ``a`` into the host array ``out`` of the same shape and dtype (counted). Into
    pinned memory with ``blocking=False`` the copy is queued on the stream: synchronize() before reading."""
    _counts.d2h += 1
    _counts.d2h_bytes += a.nbytes
    _counts.sync += bool(blocking)
    a.get(out=out, blocking=blocking)
    return out


def to_device_into(out, host):
    """Copy the host array ``host`` into device array ``out`` (counted; queued on the stream)."""
    _counts.h2d += 1
    _counts.h2d_bytes += host.nbytes
    out.set(host)
    return out


def to_scalar(a):
    """A Python number from a one-element array (on the device: a counted copy and synchronisation)."""
    if is_device_array(a):
        _counts.d2h += 1
        _counts.d2h_bytes += a.nbytes
        _counts.sync += 1
    return a.item()


def synchronize():
    """Wait for queued GPU work (a no-op on the CPU). Call before timing or before MPI reads a buffer."""
    if switch._cupy is not None and switch._device == "cuda":
        _counts.sync += 1
        switch._cupy.cuda.get_current_stream().synchronize()


def record_event():
    """A CUDA event recorded now on the current stream (None on the CPU): trace spans time the GPU."""
    if switch._device != "cuda":
        return None
    event = switch._cupy.cuda.Event()
    event.record()
    return event


def elapsed_ms(start, end, wait=True):
    """Milliseconds between two recorded events; waits for ``end`` first (a counted synchronisation)
    unless the caller already waited for a later event."""
    if wait:
        _counts.sync += 1
        end.synchronize()
    return switch._cupy.cuda.get_elapsed_time(start, end)

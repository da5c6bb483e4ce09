"""The stand-in's own state: its configuration, the current device of each host thread, and the
counters tests read (host <-> device copies, synchronisations, kernel launches, devices used).

Configuration (environment, read at import):
  CUPY_STANDIN_DEVICES=4                   how many devices ``getDeviceCount()`` reports
  CUPY_STANDIN_IMPLICIT=count|error        what the conversions CuPy itself makes silently
                                           (NumPy index arrays, NumPy values in an advanced
                                           assignment) do: counted under ``h2d_implicit`` (CuPy's
                                           behaviour), or refused with TypeError (stricter)
  CUPY_STANDIN_FORBID_DEVICE_POINTERS=1    reading ``__cuda_array_interface__`` raises TypeError:
                                           no code path of the job may hand a device pointer to
                                           anyone (mpi4py reads it; a non-CUDA-aware MPI crashes)
  CUPY_STANDIN_REPORT=PREFIX               at exit each process writes PREFIX.<pid>.json: its
                                           launcher rank, the devices it used, its counters
  CUPY_STANDIN_IPC=1                       CUDA IPC works (_ipc.py): device memory lives in shared
                                           memory that other processes on the machine map through
                                           ipcGetMemHandle / ipcOpenMemHandle (peer access on);
                                           otherwise every IPC call fails with cudaErrorNotSupported
"""
import atexit
import collections
import json
import os
import threading

DEVICE_COUNT = int(os.environ.get("CUPY_STANDIN_DEVICES", "4"))
IMPLICIT = os.environ.get("CUPY_STANDIN_IMPLICIT", "count")
FORBID_DEVICE_POINTERS = os.environ.get("CUPY_STANDIN_FORBID_DEVICE_POINTERS", "0") == "1"
REPORT = os.environ.get("CUPY_STANDIN_REPORT")
IPC = os.environ.get("CUPY_STANDIN_IPC", "0") == "1"

#: h2d / d2h: explicit copies (asarray of host data, set, get, asnumpy, item, float(), repr...);
#: h2d_implicit: conversions CuPy makes without being asked; sync: the host waited for the device
#: (synchronize() of a stream, event or device, and every blocking device-to-host copy);
#: kernels: kernel launches (a fused function is one); fused: calls of cupy.fuse functions;
#: device_pointers: reads of __cuda_array_interface__; pinned_bytes: pinned host memory allocated;
#: ipc_opens: ipcOpenMemHandle calls that succeeded (a transport should open a peer's buffer once)
COUNTERS = ("h2d", "h2d_bytes", "h2d_implicit", "d2h", "d2h_bytes", "sync", "kernels", "fused",
            "device_pointers", "pinned_bytes", "ipc_opens")

_local = threading.local()
_lock = threading.Lock()
_process = dict.fromkeys(COUNTERS, 0)
_process_kernels = collections.Counter()
_devices_used = set()


def current_device():
    """The calling host thread's device (0 in a new thread, as with the CUDA runtime)."""
    return getattr(_local, "device", 0)


def set_current_device(device_id):
    _local.device = device_id


def _thread_counts():
    counts = getattr(_local, "counts", None)
    if counts is None:
        counts = _local.counts = dict.fromkeys(COUNTERS, 0)
        _local.kernels = collections.Counter()
    return counts


def add(name, n=1):
    _thread_counts()[name] += n
    with _lock:
        _process[name] += n


def kernel(name):
    """One kernel launch on the current device (unless inside a fused function)."""
    if fusing():
        return
    device = current_device()
    _thread_counts()["kernels"] += 1
    _local.kernels[name] += 1
    with _lock:
        _process["kernels"] += 1
        _process_kernels[name] += 1
        _devices_used.add(device)


def allocated(device):
    with _lock:
        _devices_used.add(device)


def allocation_range(ptr):
    """(base, size, id) of the device allocation holding ``ptr``: what the CUDA driver's
    cuPointerGetAttributes answers, which CuPy does not wrap (code that needs it asks the driver
    through ctypes on a GPU, and this function under the stand-in). None: not an exportable
    allocation (without CUPY_STANDIN_IPC=1, none is)."""
    from . import _ipc
    return _ipc.allocation_range(int(ptr))


def implicit(what, nbytes):
    """A conversion CuPy makes silently (host data used as if it were on the device)."""
    if IMPLICIT == "error":
        raise TypeError(f"implicit host-to-device conversion of {what} (CuPy copies it silently; the "
                        "strict CuPy stand-in refuses it): move it with cupy.asarray() on purpose")
    add("h2d_implicit")
    add("h2d_bytes", nbytes)


def counters(scope="thread"):
    """A copy of the counters of the calling thread ("thread") or of the whole process ("process"),
    with ``kernel_names``: launches per kernel name."""
    if scope == "process":
        with _lock:
            return {**_process, "kernel_names": dict(_process_kernels)}
    counts = _thread_counts()
    return {**counts, "kernel_names": dict(_local.kernels)}


def devices_used():
    with _lock:
        return sorted(_devices_used)


def reset():
    """Zero every counter (this thread's and the process's) and forget the devices used."""
    with _lock:
        for k in _process:
            _process[k] = 0
        _process_kernels.clear()
        _devices_used.clear()
    counts = _thread_counts()
    for k in counts:
        counts[k] = 0
    _local.kernels.clear()


class counting:
    """``with counting() as c: ...`` then ``c.delta["sync"]``, ``c.delta["kernel_names"]``: what the
    calling thread did inside the block."""

    def __enter__(self):
        self._before = counters()
        self.delta = None
        return self

    def __exit__(self, *exc):
        after = counters()
        self.delta = {k: after[k] - self._before[k] for k in COUNTERS}
        names = collections.Counter(after["kernel_names"])
        names.subtract(self._before["kernel_names"])
        self.delta["kernel_names"] = {k: v for k, v in names.items() if v}
        return False


# ---- fusion: while a fused function runs, its operations are one kernel, and only what
# cupy.fuse compiles is allowed (ufuncs, cupy.where, astype, one reduction at the end)
def fusing():
    return getattr(_local, "fusion", None) is not None


def fusion_state():
    return getattr(_local, "fusion", None)


def set_fusion_state(state):
    _local.fusion = state


def _write_report():
    rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ), "0")
    local = next((os.environ[v] for v in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK") if v in os.environ), None)
    with _lock:
        report = {"pid": os.getpid(), "rank": int(rank), "local_rank": None if local is None else int(local),
                  "device_count": DEVICE_COUNT, "devices_used": sorted(_devices_used),
                  "counters": dict(_process), "kernel_names": dict(_process_kernels)}
    with open(f"{REPORT}.{os.getpid()}.json", "w") as f:
        json.dump(report, f)


if REPORT:
    atexit.register(_write_report)

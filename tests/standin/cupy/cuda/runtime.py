"""``cupy.cuda.runtime`` of the stand-in: devices, synchronisation, and CUDA IPC, which fails as it
fails where it is not supported (``cudaErrorNotSupported``: some containers, and here by default),
so that code built on it must fall back; with CUPY_STANDIN_IPC=1 it works between the processes of
one machine (_ipc.py), with CuPy 14.2's signatures (cupy_backends/cuda/api/runtime.pyx: handles are
64 ``bytes``, opened pointers and events are ints), and peer access is possible between devices.
Errors are ``CUDARuntimeError(status)`` with CuPy's message ``"<name>: <description>"`` and ``.status``.
"""
from .. import _standin as S

cudaErrorInvalidValue = 1
cudaErrorInvalidDevice = 101
cudaErrorInvalidContext = 201
cudaErrorInvalidResourceHandle = 400
cudaErrorNotSupported = 801
cudaIpcMemLazyEnablePeerAccess = 1
eventDefault, eventBlockingSync, eventDisableTiming, eventInterprocess = 0, 1, 2, 4
errorInvalidValue = cudaErrorInvalidValue
errorInvalidResourceHandle = cudaErrorInvalidResourceHandle
is_hip = False

_ERRORS = {
    cudaErrorInvalidValue: ("cudaErrorInvalidValue", "invalid argument"),
    cudaErrorInvalidDevice: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    cudaErrorInvalidContext: ("cudaErrorInvalidContext", "invalid device context"),
    cudaErrorInvalidResourceHandle: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    cudaErrorNotSupported: ("cudaErrorNotSupported", "operation not supported"),
}

class CUDARuntimeError(RuntimeError):
    def __init__(self, status):
        self.status = status
        name, text = _ERRORS.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return type(self), (self.status,)


def getDeviceCount():
    return S.DEVICE_COUNT


def getDevice():
    return S.current_device()


def setDevice(device):
    if not 0 <= int(device) < S.DEVICE_COUNT:
        raise CUDARuntimeError(cudaErrorInvalidDevice)
    S.set_current_device(int(device))


def deviceSynchronize():
    S.add("sync")


def getDeviceProperties(device):
    if not 0 <= int(device) < S.DEVICE_COUNT:
        raise CUDARuntimeError(cudaErrorInvalidDevice)
    return {"name": b"CuPy stand-in (NumPy)", "totalGlobalMem": 16 << 30, "major": 9, "minor": 0,
            "multiProcessorCount": 1, "pciBusID": int(device), "pciDeviceID": 0}


def memGetInfo():
    return 16 << 30, 16 << 30


def runtimeGetVersion():
    return 13000


def driverGetVersion():
    return 13000


def deviceCanAccessPeer(device, peer):
    return 1 if S.IPC else 0


def _ipc_unsupported(*args, **kwargs):
    """CUDA IPC is not supported here (as in some containers): every IPC call fails like that."""
    raise CUDARuntimeError(cudaErrorNotSupported)


def _ipc():
    if not S.IPC:
        _ipc_unsupported()
    from .. import _ipc as ipc
    return ipc


def ipcGetMemHandle(devPtr):
    """64 bytes naming the allocation whose *base* is ``devPtr`` (CUDA: "Base pointer to previously
    allocated device memory")."""
    handle = _ipc().get_mem_handle(int(devPtr))
    if handle is None:
        raise CUDARuntimeError(cudaErrorInvalidValue)
    return handle


def ipcOpenMemHandle(handle, flags=cudaIpcMemLazyEnablePeerAccess):
    """The allocation's base pointer in this process; the exporting process itself may not open it."""
    if not isinstance(handle, bytes) or len(handle) != 64:
        raise TypeError("ipcOpenMemHandle: the handle must be the 64 bytes ipcGetMemHandle returned")
    ptr = _ipc().open_mem_handle(handle)
    if ptr == "own":
        raise CUDARuntimeError(cudaErrorInvalidContext)
    if ptr == "invalid":
        raise CUDARuntimeError(cudaErrorInvalidResourceHandle)
    return ptr


def ipcCloseMemHandle(devPtr):
    if not _ipc().close_mem_handle(int(devPtr)):
        raise CUDARuntimeError(cudaErrorInvalidValue)


def ipcGetEventHandle(event):
    handle = _ipc().get_event_handle(int(event))
    if handle is None:                   # not an event, or one made without interprocess=True
        raise CUDARuntimeError(cudaErrorInvalidResourceHandle)
    return handle


def ipcOpenEventHandle(handle):
    ptr = _ipc().open_event_handle(handle)
    if ptr in ("own", "invalid"):
        raise CUDARuntimeError(cudaErrorInvalidContext if ptr == "own" else cudaErrorInvalidResourceHandle)
    return ptr


def streamWaitEvent(stream, event, flags=0):
    """Work queued on ``stream`` after this waits for ``event`` (eager here: only the event is checked)."""
    from .. import _ipc as ipc
    if not ipc.known_event(int(event)):
        raise CUDARuntimeError(cudaErrorInvalidResourceHandle)

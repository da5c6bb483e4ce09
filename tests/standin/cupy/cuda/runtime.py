"""``cupy.cuda.runtime`` of the stand-in: devices, synchronisation, and CUDA IPC, which fails as it
fails where it is not supported (``cudaErrorNotSupported``: some containers, and here), so that
code built on it must fall back. Errors are ``CUDARuntimeError(status)`` with CuPy's message
``"<name>: <description>"`` and ``.status``.
"""
from .. import _standin as S

cudaErrorInvalidValue = 1
cudaErrorInvalidDevice = 101
cudaErrorInvalidResourceHandle = 400
cudaErrorNotSupported = 801
cudaIpcMemLazyEnablePeerAccess = 1
errorInvalidValue = cudaErrorInvalidValue
errorInvalidResourceHandle = cudaErrorInvalidResourceHandle
is_hip = False

_ERRORS = {
    cudaErrorInvalidValue: ("cudaErrorInvalidValue", "invalid argument"),
    cudaErrorInvalidDevice: ("cudaErrorInvalidDevice", "invalid device ordinal"),
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
    return 0


def _ipc_unsupported(*args, **kwargs):
    """CUDA IPC is not supported here (as in some containers): every IPC call fails like that."""
    raise CUDARuntimeError(cudaErrorNotSupported)


def ipcGetMemHandle(devPtr):
    return _ipc_unsupported(devPtr)


def ipcOpenMemHandle(handle, flags=cudaIpcMemLazyEnablePeerAccess):
    return _ipc_unsupported(handle, flags)


def ipcCloseMemHandle(devPtr):
    return _ipc_unsupported(devPtr)


def ipcGetEventHandle(event):
    return _ipc_unsupported(event)


def ipcOpenEventHandle(handle):
    return _ipc_unsupported(handle)

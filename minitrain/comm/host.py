"""The host transport: arrays handed to MPI as they are, through mpi4py's buffer API (never pickle).

An array travels as [buf, MPI.BYTE], so every NumPy dtype works; a receive posts a status, from which
the byte count that arrived is read (the Communicator's size check: free) and an MPI_ERR_TRUNCATE
becomes MessageTruncated. mpi_buffer is the one place where an array reaches mpi4py: a device array
there is refused unless the MPI library is CUDA-aware, since a device pointer handed to any other MPI
is a segmentation fault, not an error. Cost: MPI's own, alpha + N·b·beta per message.
"""
import ctypes
import os

from .. import backend
from .errors import CommError, MessageTruncated
from .wire import Request, Transport

_MPI = None


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI     # initialises MPI (MPI_THREAD_MULTIPLE, mpi4py's default)
        _MPI = MPI
    return _MPI


def cuda_aware():
    """True when the loaded MPI library reports CUDA support, or MINITRAIN_CUDA_AWARE=1."""
    if os.environ.get("MINITRAIN_CUDA_AWARE") == "1":
        return True
    MPI = _mpi()
    try:
        lib = ctypes.CDLL(MPI.__file__, mode=ctypes.RTLD_GLOBAL)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


_CUDA_AWARE = None


def mpi_is_cuda_aware():
    """Whether the loaded MPI reads device memory (asked once per process; MINITRAIN_CUDA_AWARE=1 forces yes)."""
    global _CUDA_AWARE
    if _CUDA_AWARE is None:
        _CUDA_AWARE = cuda_aware()
    return _CUDA_AWARE


class DevicePointerRefused(CommError):
    """A device array was about to reach an MPI library that cannot read device memory."""


def mpi_buffer(buf):
    """``[buf, MPI.BYTE]`` for mpi4py: every array handed to MPI passes here. A device array passes
    only when MPI is CUDA-aware; otherwise this raises before mpi4py can read a device pointer."""
    if backend.is_device_array(buf) and not mpi_is_cuda_aware():
        raise DevicePointerRefused(
            f"a device array ({buf.dtype}, shape {tuple(buf.shape)}) was handed to MPI, which is not CUDA-aware "
            "(MPIX_Query_cuda_support() is 0): it would read a device pointer as host memory and crash. Device "
            "buffers go through the communicator's transport (minitrain.comm.transport)")
    return [buf, _mpi().BYTE]


class MPIRequest(Request):
    def __init__(self, request, peer, kind, status=None, on_complete=None):
        super().__init__(peer, kind)
        self._request, self._status = request, status
        self._on_complete = on_complete
        self._done = False

    def test(self):
        if not self._done:
            try:
                flag = self._request.Test(self._status)
            except Exception as e:
                if getattr(e, "Get_error_class", None) and e.Get_error_class() == _mpi().ERR_TRUNCATE:
                    raise MessageTruncated() from None
                raise
            if flag:
                self._done = True
                if self._status is not None:
                    self.received = self._status.Get_count(_MPI.BYTE)
                if self._on_complete is not None:
                    self._on_complete()
        return self._done

    def cancel(self):
        """A receive nobody waits for any more is withdrawn (MPI_Cancel), so that it cannot take a
        later message meant for another receive."""
        if self._done or self.kind != "recv from":
            return
        try:
            self._request.Cancel()
            self._request.Wait()
        except Exception:           # already failed or matched: nothing left to withdraw
            pass
        self._done = True


class HostTransport(Transport):
    """The buffer to MPI as it is, on ``comm.mpi_comm``: a host array (a device array only if MPI is
    CUDA-aware: mpi_buffer). The device transports lend it for their own small messages."""

    name = "host"

    def isend(self, buf, dest, tag):
        return MPIRequest(self.comm.mpi_comm.Isend(mpi_buffer(buf), dest, tag), dest, "send to")

    def irecv(self, buf, source, tag):
        """With a status: the byte count that arrived is checked against buf (the receive contract)."""
        status = _mpi().Status() if self.comm.verify_sizes else None
        return MPIRequest(self.comm.mpi_comm.Irecv(mpi_buffer(buf), source, tag), source, "recv from", status)

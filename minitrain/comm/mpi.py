"""MPICommunicator: the Communicator over mpi4py's buffer API (never pickle for arrays).

Arrays travel as raw bytes ([buf, MPI.BYTE]), so every NumPy dtype works, float16 included,
and the two sides must agree on sizes (the collectives guarantee it; debug mode checks it).
CuPy arrays are staged through host memory unless MPI says it is CUDA-aware
(MPIX_Query_cuda_support via ctypes) or MINITRAIN_CUDA_AWARE=1 forces the direct path:
the PyPI mpich wheel is not CUDA-aware, and a device pointer given to it would crash.
init() is the entry point for jobs: it wraps COMM_WORLD, caps BLAS threads per rank, and
installs the hook that turns an uncaught exception on any rank into "[rank r] traceback" and an
MPI Abort of the whole job, instead of leaving the other ranks waiting forever.
"""
import ctypes
import os
import sys
import time
import traceback

import numpy as np

from .. import backend
from .communicator import Communicator, Request


def _mpi():
    from mpi4py import MPI     # initialises MPI (MPI_THREAD_MULTIPLE, mpi4py's default)
    return MPI


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


class MPIRequest(Request):
    def __init__(self, request, peer, kind, on_complete=None):
        super().__init__(peer, kind)
        self._request = request
        self._on_complete = on_complete
        self._done = False

    def test(self):
        if not self._done and self._request.Test():
            self._done = True
            if self._on_complete is not None:
                self._on_complete()
        return self._done


class MPICommunicator(Communicator):
    def __init__(self, mpi_comm=None, timeout=None):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(self.mpi_comm.Get_rank(), self.mpi_comm.Get_size(), timeout)
        self._byte = MPI.BYTE
        self._cuda_aware = None

    def _host_view(self, buf):
        """(host buffer to hand to MPI, whether it is a staging copy)."""
        if backend.is_device_array(buf):
            if self._cuda_aware is None:
                self._cuda_aware = cuda_aware()
            backend.synchronize()
            if not self._cuda_aware:
                return backend.to_host(buf), True
        return buf, False

    def _isend(self, buf, dest, tag):
        host, _ = self._host_view(buf)
        # the staging copy (if any) is kept alive by the closure until the send completes
        request = self.mpi_comm.Isend([host, self._byte], dest, tag)
        return MPIRequest(request, dest, "send to", on_complete=lambda: host)

    def _irecv(self, buf, source, tag):
        if backend.is_device_array(buf):
            host, staged = self._host_view(buf)
            if staged:
                host = np.empty(buf.shape, buf.dtype)
                request = self.mpi_comm.Irecv([host, self._byte], source, tag)
                return MPIRequest(request, source, "recv from",
                                  on_complete=lambda: buf.set(host))
        request = self.mpi_comm.Irecv([buf, self._byte], source, tag)
        return MPIRequest(request, source, "recv from")

    def _split(self, color, key):
        return MPICommunicator(self.mpi_comm.Split(color, key), timeout=self.timeout)

    def abort(self, code=1):
        """Stop every rank of the job. What this rank wrote gets ABORT_GRACE_S to reach the launcher
        first (without it, under load, the job died and its message was lost: seen in CI)."""
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        _mpi().COMM_WORLD.Abort(code)


ABORT_GRACE_S = 0.5


def install_excepthook(rank):
    """An uncaught exception prints ``[rank r]`` and its traceback, then aborts every rank.
    The text goes out in one unbuffered write, and the launcher gets ABORT_GRACE_S to forward it
    before MPI_Abort tears the job down (seen once under load: the abort won the race and the
    traceback never reached the terminal)."""
    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        labelled = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines())
        try:
            sys.stdout.flush()
            os.write(2, labelled.encode(errors="replace"))
        finally:
            time.sleep(ABORT_GRACE_S)
            _mpi().COMM_WORLD.Abort(1)
    sys.excepthook = hook


def init(timeout=None, limit_threads=True):
    """Entry point of an MPI job: COMM_WORLD as a Communicator, BLAS threads capped to the
    rank's share of the cores, the abort-on-error hook installed, and, on the GPU, this rank's
    device chosen: GPU ``local_rank % device_count`` (the launcher's local rank, so ranks on one
    node spread over its GPUs, and share them round-robin when there are more ranks than GPUs)."""
    comm = MPICommunicator(timeout=timeout)
    if backend.get_device() == "cuda":
        backend.use_gpu(backend.local_rank() % backend.gpu_count())
    if limit_threads:
        backend.limit_blas_threads()
    install_excepthook(comm.rank)
    return comm

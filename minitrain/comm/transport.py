"""How device buffers cross MPI ranks: one transport per communicator, chosen when the job starts.

Host (NumPy) arrays go to MPI as they are. A device (CuPy) array goes through the communicator's
transport, the first of these that works here (describe(comm) names it in the job's table):

  cuda-aware-mpi  MPI reads and writes device memory itself (MPIX_Query_cuda_support() is 1)
  cuda-ipc        ranks on one node map each other's device memory (ipc.py): the receiver's kernel
                  reads the sender's buffer, N·b bytes through HBM / NVLink, no host copy
  pinned-staging  device -> pinned host -> MPI -> pinned host -> device: per message of N·b bytes,
                  two PCIe copies (2·N·b / B_pcie) beside MPI's alpha + N·b·beta

Staging buffers are page-locked, allocated once per communicator (grown on demand), reused, and
counted in the memory ledger under comm_buffers (host). mpi_buffer is the one place where an
array reaches mpi4py: a device array there is refused unless the MPI library is CUDA-aware, since a
device pointer handed to any other MPI is a segmentation fault, not an error.
"""
import os
import sys
import threading

import numpy as np

from .. import backend, memory
from .communicator import CommError, Request

NAMES = ("cuda-aware-mpi", "cuda-ipc", "pinned-staging")
#: recvbuf = message (op) own, elementwise: what a ring reduce-scatter step does with what arrives
REDUCE_UFUNCS = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}


class DevicePointerRefused(CommError):
    """A device array was about to reach an MPI library that cannot read device memory."""


_CUDA_AWARE = None


def mpi_is_cuda_aware():
    """Whether the loaded MPI reads device memory (asked once per process; MINITRAIN_CUDA_AWARE=1 forces yes)."""
    global _CUDA_AWARE
    if _CUDA_AWARE is None:
        from .mpi import cuda_aware
        _CUDA_AWARE = cuda_aware()
    return _CUDA_AWARE


def mpi_buffer(buf):
    """``[buf, MPI.BYTE]`` for mpi4py: every array handed to MPI passes here. A device array passes
    only when MPI is CUDA-aware; otherwise this raises before mpi4py can read a device pointer."""
    if backend.is_device_array(buf) and not mpi_is_cuda_aware():
        raise DevicePointerRefused(
            f"a device array ({buf.dtype}, shape {tuple(buf.shape)}) was handed to MPI, which is not CUDA-aware "
            "(MPIX_Query_cuda_support() is 0): it would read a device pointer as host memory and crash. Device "
            "buffers go through the communicator's transport (minitrain.comm.transport)")
    from mpi4py import MPI
    return [buf, MPI.BYTE]


class StagedRequest(Request):
    """A request that finishes the move when the inner (MPI) request completes: ``on_done()`` runs once,
    and the byte count MPI reported (``received``) is passed up for the size check."""

    def __init__(self, inner, on_done=None):
        super().__init__(inner.peer, inner.kind)
        self.inner, self.on_done, self.done = inner, on_done, False

    def test(self):
        if not self.done and self.inner.test():
            self.received = getattr(self.inner, "received", None)
            if self.on_done is not None:
                self.on_done()
            self.done = True
        return self.done

    def cancel(self):
        """A receive nobody waits for any more: withdraw the MPI receive under it."""
        if not self.done:
            self.inner.cancel()
            self.done = True


class DeviceTransport:
    """``isend`` / ``irecv`` of device arrays for one MPICommunicator (``comm``), which lends its host
    path (``_mpi_isend`` / ``_mpi_irecv``). ``split(child)`` makes the transport of a sub-communicator
    (collective over the child's ranks); ``close()`` gives back what the transport holds."""

    name = "?"

    def __init__(self, comm):
        self.comm = comm

    def isend(self, buf, dest, tag):
        raise NotImplementedError

    def irecv(self, buf, source, tag):
        raise NotImplementedError

    def split(self, child):
        return type(self)(child)

    def close(self):
        pass


class CudaAwareMPITransport(DeviceTransport):
    """The device buffer itself goes to MPI, after the stream has finished writing it."""

    name = "cuda-aware-mpi"

    def isend(self, buf, dest, tag):
        backend.synchronize()
        return self.comm._mpi_isend(buf, dest, tag)

    def irecv(self, buf, source, tag):
        backend.synchronize()            # no kernel still reads or writes the buffer MPI writes into
        return self.comm._mpi_irecv(buf, source, tag)


class PinnedPool:
    """Page-locked host blocks (powers of two, at least 4 KiB): a message takes one and gives it
    back when it completes, so steady state allocates nothing. Counted under comm_buffers (host)."""

    MIN_BLOCK = 4096

    def __init__(self):
        self.free, self.blocks = [], []
        self.lock = threading.Lock()

    def take(self, nbytes):
        with self.lock:
            fits = [b for b in self.free if len(b[1]) >= nbytes]
            if fits:
                block = min(fits, key=lambda b: len(b[1]))
                self.free.remove(block)
                return block
        size = max(self.MIN_BLOCK, 1 << max(0, nbytes - 1).bit_length())
        pinned = backend._import_cupy().cuda.alloc_pinned_memory(size)
        block = (len(self.blocks), np.frombuffer(pinned, np.uint8, size), pinned)
        with self.lock:
            self.blocks.append(block)
        memory.tracker().add("comm_buffers", ("pinned_staging", id(self), block[0]), size, host=True)
        return block

    def give(self, block):
        with self.lock:
            self.free.append(block)

    @property
    def nbytes(self):
        return sum(len(b[1]) for b in self.blocks)

    def close(self):
        for block in self.blocks:
            memory.tracker().remove(("pinned_staging", id(self), block[0]))
        self.free, self.blocks = [], []


def _view(block, like):
    """The first ``like.nbytes`` bytes of a pinned block as a host array of ``like``'s dtype and shape."""
    return block[1][:like.nbytes].view(like.dtype).reshape(like.shape)


class PinnedStagingTransport(DeviceTransport):
    """device -> pinned -> MPI -> pinned -> device. A send copies into a pinned block and waits for
    the copy (a stream sync) before MPI reads it; a receive copies out of its block when MPI is done
    and waits for that copy before the block is reused."""

    name = "pinned-staging"

    def __init__(self, comm):
        super().__init__(comm)
        self.pool = PinnedPool()

    def isend(self, buf, dest, tag):
        if buf.nbytes == 0:
            return self.comm._mpi_isend(np.empty(0, np.uint8), dest, tag)
        block = self.pool.take(buf.nbytes)
        host = _view(block, buf)
        backend.to_host_into(buf, host, blocking=False)
        backend.synchronize()
        return StagedRequest(self.comm._mpi_isend(host, dest, tag), lambda: self.pool.give(block))

    def irecv(self, buf, source, tag):
        if buf.nbytes == 0:
            return self.comm._mpi_irecv(np.empty(0, np.uint8), source, tag)
        block = self.pool.take(buf.nbytes)
        host = _view(block, buf)

        def arrived():
            backend.to_device_into(buf, host)
            backend.synchronize()            # the copy has left the block: it may take the next message
            self.pool.give(block)
        return StagedRequest(self.comm._mpi_irecv(host, source, tag), arrived)

    def close(self):
        self.pool.close()


# ---------------------------------------------------------------- choosing one
def choose(comm, want="auto"):
    """(transport, note) for an MPICommunicator on the GPU; collective (every rank calls it, and all
    reach the same answer). ``want``: auto (the first that works, in the order of NAMES) or one of
    NAMES (an error if it cannot work here). The note says what was passed over and why."""
    if want not in ("auto",) + NAMES:
        raise ValueError(f"unknown transport {want!r}: expected auto or one of {NAMES}")
    notes = []
    if want in ("auto", "cuda-aware-mpi"):
        if mpi_is_cuda_aware():
            return CudaAwareMPITransport(comm), ""
        if want == "cuda-aware-mpi":
            raise CommError("transport 'cuda-aware-mpi': this MPI is not CUDA-aware (MPIX_Query_cuda_support() is 0)")
        notes.append("MPI is not CUDA-aware")
    if want in ("auto", "cuda-ipc"):
        from .ipc import negotiate
        ipc, why = negotiate(comm)
        if ipc is not None:
            return ipc, "; ".join(notes + ([why] if why else []))
        if want == "cuda-ipc":
            raise CommError(f"transport 'cuda-ipc' cannot work here: {why}")
        notes.append(f"no CUDA IPC: {why}")
    return PinnedStagingTransport(comm), "; ".join(notes)


def setup(comm, transport=None):
    """Give an MPICommunicator its device transport (on the GPU; on the CPU only host arrays move).
    ``transport``: None reads MINITRAIN_TRANSPORT (default auto). A fallback is said once, on rank 0."""
    want = transport or os.environ.get("MINITRAIN_TRANSPORT") or "auto"
    if backend.get_device() != "cuda":
        if want != "auto":
            raise ValueError(f"transport {want!r} moves device buffers: select the GPU first (MINITRAIN_DEVICE=cuda)")
        return comm
    comm.transport, comm.transport_note = choose(comm, want)
    if comm.transport_note and comm.rank == 0:
        sys.stderr.write(f"minitrain: device buffers move by {comm.transport.name} ({comm.transport_note})\n")
        sys.stderr.flush()
    return comm


def default_transport(comm):
    """The transport of a communicator nobody negotiated for: one that needs no agreement between ranks
    (CUDA-aware MPI, else pinned staging: both put plain MPI messages on the wire)."""
    return CudaAwareMPITransport(comm) if mpi_is_cuda_aware() else PinnedStagingTransport(comm)


def describe(comm):
    """The name the job's table prints: nccl, a device transport, host (the CPU), or in-process."""
    if getattr(comm, "backend_name", None) == "nccl":
        return "nccl"
    if not hasattr(comm, "mpi_comm"):
        return "in-process"
    if backend.get_device() != "cuda":
        return "host"
    t = getattr(comm, "transport", None)
    if t is not None:
        return t.name
    return "cuda-aware-mpi" if mpi_is_cuda_aware() else "pinned-staging"

"""Device buffers through MPI: CUDA-aware MPI (the device buffer itself), or pinned staging.

  cuda-aware-mpi  MPI reads and writes device memory itself (MPIX_Query_cuda_support() is 1)
  pinned-staging  device -> pinned host -> MPI -> pinned host -> device: per message of N·b bytes,
                  two PCIe copies (2·N·b / B_pcie) beside MPI's alpha + N·b·beta

Staging buffers are page-locked, allocated once per communicator (grown on demand), reused, and
counted in the memory ledger under comm_buffers (host). Both put plain MPI messages on the wire, by
the communicator's host transport (host.py), so they need no agreement between ranks.
"""
import threading

import numpy as np

from .. import backend, memory
from .wire import Request, Transport


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


class CudaAwareMPITransport(Transport):
    """The device buffer itself goes to MPI, after the stream has finished writing it."""

    name = "cuda-aware-mpi"

    def isend(self, buf, dest, tag):
        backend.synchronize()
        return self.comm.host.isend(buf, dest, tag)

    def irecv(self, buf, source, tag):
        backend.synchronize()            # no kernel still reads or writes the buffer MPI writes into
        return self.comm.host.irecv(buf, source, tag)


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


class PinnedStagingTransport(Transport):
    """device -> pinned -> MPI -> pinned -> device. A send copies into a pinned block and waits for
    the copy (a stream sync) before MPI reads it; a receive copies out of its block when MPI is done
    and waits for that copy before the block is reused."""

    name = "pinned-staging"

    def __init__(self, comm):
        super().__init__(comm)
        self.pool = PinnedPool()

    def isend(self, buf, dest, tag):
        if buf.nbytes == 0:
            return self.comm.host.isend(np.empty(0, np.uint8), dest, tag)
        block = self.pool.take(buf.nbytes)
        host = _view(block, buf)
        backend.to_host_into(buf, host, blocking=False)
        backend.synchronize()
        return StagedRequest(self.comm.host.isend(host, dest, tag), lambda: self.pool.give(block))

    def irecv(self, buf, source, tag):
        if buf.nbytes == 0:
            return self.comm.host.irecv(np.empty(0, np.uint8), source, tag)
        block = self.pool.take(buf.nbytes)
        host = _view(block, buf)

        def arrived():
            backend.to_device_into(buf, host)
            backend.synchronize()            # the copy has left the block: it may take the next message
            self.pool.give(block)
        return StagedRequest(self.comm.host.irecv(host, source, tag), arrived)

    def close(self):
        self.pool.close()

"""The one interface every transport implements: how a backend's bytes cross to another rank.

A transport moves raw bytes under a wire tag (communicator.py builds it) and never counts, checks or
times anything: the Communicator above it does, once for all of them. isend / irecv return
a Request; its test() says when the move is complete and, for a receive, sets received (the
byte count that arrived: the Communicator checks it against the buffer) or raises MessageTruncated.
The transports: host arrays by MPI (host.py), device arrays by CUDA-aware MPI or pinned staging
(staging.py) or CUDA IPC (ipc.py), by NCCL (nccl.py), and between threads (local.py). The collectives
see none of them: they call the Communicator.
"""
import functools

import numpy as np

from .errors import MessageTruncated  # noqa: F401  (what a transport's test() raises)

DTYPE_SLOTS = 16                  # wire tag = logical tag * 16 + dtype code: < 2^21, under every MPI's TAG_UB
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
               "uint64", "uint32", "uint16", "uint8", "bool", "complex64", "complex128")

#: recvbuf = message (op) own, elementwise: what a ring reduce-scatter step does with what arrives
REDUCE_UFUNCS = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum", "prod": "multiply"}


class Request:
    """A pending send or receive. Transports implement ``test()`` and set ``received`` (bytes that
    arrived) when a receive completes; the Communicator fills in ``buf``, ``tag``, ``record`` and
    ``communicator`` (itself: wait() and is_completed() go through it; a transport's request may keep
    another communicator of its own, as ThreadWorld's under NCCL keeps the bootstrap's)."""

    received = None
    buf = tag = record = communicator = None

    def __init__(self, peer, kind):
        self.peer, self.kind = peer, kind

    def test(self):
        raise NotImplementedError

    def wait(self):
        """Block until done, as the Work of torch.distributed.isend / irecv (the communicator's timeouts
        and checks apply: a receive of another size raises); returns True."""
        self.communicator.wait_all([self], f"wait ({self.kind} rank {self.peer}, tag {self.tag})")
        return True

    def is_completed(self):
        return self.communicator.test(self, f"is_completed ({self.kind} rank {self.peer}, tag {self.tag})")

    def cancel(self):
        """Withdraw a receive that will not be waited for (a transport that posts receives overrides)."""

    def reduce_on_arrival(self, own, op):
        """Ask a pending receive to arrive as ``recvbuf = message (op) own`` (a reduce-scatter step).
        True if the transport does it (CUDA IPC: in the kernel that reads the peer's memory); False
        (here): the caller combines after the wait."""
        return False


class Transport:
    """``isend`` / ``irecv`` for one communicator (``comm``). ``split(child)`` makes the transport of a
    sub-communicator (collective over the child's ranks); ``close()`` gives back what it holds."""

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


@functools.lru_cache(maxsize=None)
def dtype_code(dtype):
    """0..15: the dtype's slot in the wire tag (15: any other dtype), so a message of another dtype never matches."""
    name = np.dtype(dtype).name
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else DTYPE_SLOTS - 1

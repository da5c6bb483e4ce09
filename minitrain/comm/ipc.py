"""The CUDA IPC transport: ranks on one node read each other's device memory, as NCCL's P2P
transport does inside a node (CUDA programming guide, "Interprocess Communication").

One message of N·b bytes, the sender's buffer read in place:
  sender    describes the buffer (the cudaIpcMemHandle of its allocation, the offset, N·b), marks its
            stream (records an interprocess event; sync="host": synchronises instead) and sends the
            176-byte descriptor over MPI under the message's tag;
  receiver  opens the allocation once (cudaIpcOpenMemHandle, cached by peer and allocation id), makes
            its stream wait for the sender's event, runs ONE kernel over the peer's bytes (a copy into
            recvbuf, or recvbuf = peer (op) own for a reduce-scatter step), marks its stream and sends
            an 80-byte acknowledgement on a duplicate communicator;
  sender    makes its stream wait for the receiver's event: nothing queued after the send overwrites
            the buffer before the peer has read it.
Cost: 2 small MPI messages and one kernel reading N·b bytes; no host copy, and in event mode no host
wait either. Handles name cudaMalloc'ed allocations, found with the driver's cuPointerGetAttributes.
"""
import collections
import os
import socket
import threading

import numpy as np

from .. import backend
from .errors import CommError
from .cuda_allocations import allocation_range
from .host import mpi_buffer
from .wire import REDUCE_UFUNCS, Request, Transport

# What this relies on, as read (CuPy 14.2, cupy_backends/cuda/api/runtime.pyx; CUDA runtime API docs):
#   ipcGetMemHandle(ptr) -> 64 bytes; CUDA wants the *base* of a cudaMalloc allocation ("Base pointer to previously
#     allocated device memory"), and a freed-then-reallocated address gets a new handle;
#   ipcOpenMemHandle(handle: bytes, flags=cudaIpcMemLazyEnablePeerAccess) -> int, the allocation's base here;
#     opening an open handle again returns the same pointer (reference counted); freeing an exported allocation
#     before its importers close it is undefined behaviour (hence close());
#   ipcGetEventHandle(event ptr) -> 64 bytes (the event made with interprocess=True, disable_timing=True);
#   ipcOpenEventHandle(bytes) -> int (a CUevent); streamWaitEvent(stream ptr, event ptr, flags);
#   cupy.cuda.UnownedMemory(ptr, size, owner, device_id) + MemoryPointer(mem, offset) wrap a raw pointer.
MAGIC = 0x6D74_6970_6331           # "mtipc1": a descriptor, not a host array sent by mistake
LAZY_PEER_ACCESS = 1                # cudaIpcMemLazyEnablePeerAccess: map a peer GPU's memory, enabling peer access
DESCRIPTOR_WORDS, ACK_WORDS = 22, 10
SYNC_MODES = ("event", "host")
def _reason(e):
    return f"{type(e).__name__}: {e}" if not type(e).__name__.startswith("CUDARuntime") else str(e)


class CudaIpcTransport(Transport):
    """Device buffers of one MPICommunicator moved by CUDA IPC (see the module docstring).
    ``sync``: "event" (interprocess events; the host never waits) or "host" (stream syncs)."""

    name = "cuda-ipc"
    OPEN_CACHE = 256                     # peers' allocations kept open (least recently used closed first)

    def __init__(self, comm, ack_comm, sync="event"):
        super().__init__(comm)
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        self.ack_comm, self.sync = ack_comm, sync
        self.cupy = backend._import_cupy()
        self.runtime = self.cupy.cuda.runtime
        self.device = self.runtime.getDevice()
        self.handles = collections.OrderedDict()      # my allocation id -> its handle (8 int64 words)
        self.opened = collections.OrderedDict()       # (peer, its allocation id) -> UnownedMemory
        self.views = collections.OrderedDict()        # (peer, allocation, offset, shape, dtype) -> array
        self.markers = {}                             # stream ptr -> (interprocess Event, id, handle words)
        self.peer_events = {}                         # (peer, event id) -> opened event
        self.opens = 0                                # cudaIpcOpenMemHandle calls (once per peer buffer)
        self.lock = threading.RLock()

    def split(self, child):
        return CudaIpcTransport(child, child.mpi_comm.Dup(), self.sync)

    def isend(self, buf, dest, tag):
        return _IpcSend(self, buf, dest, tag)

    def irecv(self, buf, source, tag):
        return _IpcRecv(self, buf, source, tag)

    # ---- the sender's side
    def describe(self, buf, desc):
        """Fill descriptor words 1-13: bytes, offset, allocation id and size, the allocation's handle."""
        desc[1] = buf.nbytes
        if buf.nbytes == 0:
            return
        ptr = buf.data.ptr
        base, size, alloc_id = allocation_range(ptr)
        with self.lock:
            words = self.handles.get(alloc_id)
            if words is None:
                words = np.frombuffer(self.runtime.ipcGetMemHandle(base), np.int64).copy()
                self.handles[alloc_id] = words
                if len(self.handles) > 4 * self.OPEN_CACHE:
                    self.handles.popitem(last=False)
            else:
                self.handles.move_to_end(alloc_id)
        desc[2], desc[3], desc[4] = ptr - base, alloc_id, size
        desc[6:14] = words

    def mark(self):
        """(event id, event handle words) recorded on this thread's stream now; (-1, zeros) after a
        synchronisation in host mode. The peer waits for it before touching what it guards."""
        if self.sync == "host":
            backend.synchronize()
            return -1, np.zeros(8, np.int64)
        stream = self.cupy.cuda.get_current_stream()
        with self.lock:
            marker = self.markers.get(stream.ptr)
            if marker is None:
                event = self.cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
                words = np.frombuffer(self.runtime.ipcGetEventHandle(event.ptr), np.int64).copy()
                marker = self.markers[stream.ptr] = (event, len(self.markers), words)
        marker[0].record(stream)
        return marker[1], marker[2]

    # ---- the receiver's side
    def wait_for(self, peer, event_id, words):
        """This thread's stream waits for the peer's event (nothing to wait for when event_id < 0)."""
        if event_id < 0:
            return
        with self.lock:
            event = self.peer_events.get((peer, event_id))
            if event is None:
                event = self.peer_events[(peer, event_id)] = self.runtime.ipcOpenEventHandle(words.tobytes())
        self.runtime.streamWaitEvent(self.cupy.cuda.get_current_stream().ptr, event, 0)

    def peer_array(self, peer, desc, like):
        """The peer's bytes that ``desc`` describes, as a device array shaped like ``like`` (opened once)."""
        nbytes, offset, alloc_id, size = (int(v) for v in desc[1:5])
        if offset < 0 or offset + nbytes > size:
            raise CommError(f"[rank {self.comm.rank}] cuda-ipc: rank {peer} described bytes [{offset}, "
                            f"{offset + nbytes}) of an allocation of {size}")
        view_key = (peer, alloc_id, offset, like.shape, like.dtype.str)
        with self.lock:
            view = self.views.get(view_key)
            if view is not None:                     # a ring reuses its buffers: the same views each call
                self.views.move_to_end(view_key)
                return view
            mem = self.opened.get((peer, alloc_id))
            if mem is None:
                ptr = self.runtime.ipcOpenMemHandle(desc[6:14].tobytes(), LAZY_PEER_ACCESS)
                # device_id: the mapping is used by kernels on this rank's device (peer access when the
                # memory is on another GPU); CuPy would otherwise warn on every kernel that reads it
                mem = self.opened[(peer, alloc_id)] = self.cupy.cuda.UnownedMemory(ptr, size, self, device_id=self.device)
                self.opens += 1
                if len(self.opened) > self.OPEN_CACHE:
                    self._close(*self.opened.popitem(last=False))
            else:
                self.opened.move_to_end((peer, alloc_id))
            view = self.views[view_key] = self.cupy.ndarray(like.shape, like.dtype,
                                                            memptr=self.cupy.cuda.MemoryPointer(mem, offset))
            if len(self.views) > 4 * self.OPEN_CACHE:
                self.views.popitem(last=False)
        return view

    def _close(self, key, mem):
        for view_key in [k for k in self.views if k[:2] == key]:
            del self.views[view_key]
        self.runtime.deviceSynchronize()             # no queued kernel still reads the mapping
        self.runtime.ipcCloseMemHandle(mem.ptr)

    def close(self):
        """Close every peer allocation this rank opened. Collective in effect: a rank may free a buffer
        (CuPy's free_all_blocks) only after every peer that opened it has closed it (CUDA: freeing an
        exported allocation still open elsewhere is undefined behaviour)."""
        with self.lock:
            while self.opened:
                self._close(*self.opened.popitem(last=False))


class _IpcSend(Request):
    def __init__(self, t, buf, dest, tag):
        super().__init__(dest, "send to")
        self.t, self.keep, self.done = t, buf, False
        self.desc = np.zeros(DESCRIPTOR_WORDS, np.int64)
        self.desc[0] = MAGIC
        t.describe(buf, self.desc)
        self.desc[5], self.desc[14:22] = t.mark()
        self.send = t.comm.host.isend(self.desc, dest, tag)
        self.ack = np.empty(ACK_WORDS, np.int64)
        self.ack_request = t.ack_comm.Irecv(mpi_buffer(self.ack), dest, tag)

    def test(self):
        if self.done:
            return True
        if not (self.send.test() and self.ack_request.Test()):
            return False
        if self.ack[0] != 0:
            raise CommError(f"[rank {self.t.comm.rank}] send to rank {self.peer} (cuda-ipc): rank {self.peer} "
                            f"receives {int(self.ack[1])} bytes, this message has {self.keep.nbytes}")
        self.t.wait_for(self.peer, int(self.ack[1]), self.ack[2:10])
        self.done, self.keep = True, None
        return True


class _IpcRecv(Request):
    def __init__(self, t, buf, source, tag):
        super().__init__(source, "recv from")
        self.t, self.target, self.tag_ = t, buf, tag
        self.desc = np.empty(DESCRIPTOR_WORDS, np.int64)
        self.request = t.comm.host.irecv(self.desc, source, tag)
        self.reduction = None
        self.ack_request = None

    def reduce_on_arrival(self, own, op):
        """The message will arrive as recvbuf = message (op) own, in the kernel that reads it."""
        self.reduction = (own, op)
        return True

    def test(self):
        if self.ack_request is None:
            if not self.request.test():
                return False
            self._arrived()
        return self.ack_request.Test()

    def _arrived(self):
        t, desc, buf, peer = self.t, self.desc, self.target, self.peer
        arrived = getattr(self.request, "received", None)
        if desc[0] != MAGIC or (arrived is not None and arrived != desc.nbytes):
            raise CommError(f"[rank {t.comm.rank}] recv from rank {peer} (cuda-ipc): what arrived is no device "
                            "buffer's descriptor: under cuda-ipc a device array must be received from a device "
                            "array (the sender sent a host array?)")
        ack = self.ack = np.zeros(ACK_WORDS, np.int64)
        if desc[1] != buf.nbytes:
            ack[0], ack[1] = 1, buf.nbytes           # the sender raises too, instead of waiting
            self.ack_request = t.ack_comm.Isend(mpi_buffer(ack), peer, self.tag_)
            raise CommError(f"[rank {t.comm.rank}] recv from rank {peer} (cuda-ipc): the message has "
                            f"{int(desc[1])} bytes, this rank expected {buf.nbytes} ({buf.dtype}, shape {tuple(buf.shape)})")
        self.received = buf.nbytes
        if buf.nbytes:
            incoming = t.peer_array(peer, desc, buf)
            t.wait_for(peer, int(desc[5]), desc[14:22])
            if self.reduction is None:
                buf[...] = incoming
            else:
                own, op = self.reduction
                getattr(t.cupy, REDUCE_UFUNCS[op])(incoming, own.reshape(buf.shape), out=buf)
        ack[1], ack[2:10] = t.mark()
        self.ack_request = t.ack_comm.Isend(mpi_buffer(ack), peer, self.tag_)


# ---------------------------------------------------------------- can the ranks use it?
def negotiate(comm):
    """(CudaIpcTransport, note) when every rank of ``comm`` can map every other's device memory,
    else (None, why). Collective: each rank exports a small buffer, opens its left neighbour's and
    reads it back; every answer is gathered, so all ranks decide alike."""
    cupy = backend._import_cupy()
    rt = cupy.cuda.runtime
    mine = {"host": socket.gethostname(), "device": rt.getDevice(), "error": None, "handle": None, "events": None}
    probe = None
    try:
        probe = cupy.full(64, comm.rank + 1, np.int32)
        base, size, _ = allocation_range(probe.data.ptr)
        mine["handle"] = (rt.ipcGetMemHandle(base), probe.data.ptr - base, size)
    except Exception as e:                 # cudaErrorNotSupported (containers, the stand-in), no libcuda
        mine["error"] = _reason(e)
    try:
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        rt.ipcGetEventHandle(event.ptr)              # (the event must outlive the call)
    except Exception as e:
        mine["events"] = _reason(e)
    table = comm.mpi_comm.allgather(mine)
    hosts = sorted({t["host"] for t in table})
    if len(hosts) > 1:
        return None, f"the ranks are on {len(hosts)} nodes ({', '.join(hosts[:4])})"
    for r, t in enumerate(table):
        if t["error"]:
            return None, f"{t['error']} on rank {r}"
    problem = None
    for d in sorted({t["device"] for t in table} - {mine["device"]}):
        if not rt.deviceCanAccessPeer(mine["device"], d):
            problem = f"GPU {mine['device']} cannot access GPU {d} (no peer access)"
            break
    left = (comm.rank - 1) % comm.size
    if problem is None and comm.size > 1:
        handle, offset, size = table[left]["handle"]
        try:
            ptr = rt.ipcOpenMemHandle(handle, LAZY_PEER_ACCESS)
            mem = cupy.cuda.UnownedMemory(ptr, size, None, device_id=mine["device"])
            seen = cupy.ndarray((64,), np.int32, memptr=cupy.cuda.MemoryPointer(mem, offset))
            if not bool((seen == left + 1).all()):
                problem = f"the bytes read from rank {left}'s probe were wrong"
            del seen, mem
            rt.ipcCloseMemHandle(ptr)
        except Exception as e:
            problem = f"{_reason(e)} (opening rank {left}'s memory)"
    problems = comm.mpi_comm.allgather(problem)          # also: no probe is freed while a peer reads it
    for r, p in enumerate(problems):
        if p:
            return None, f"{p} on rank {r}"
    sync = os.environ.get("MINITRAIN_IPC_SYNC", "event")
    note = ""
    events = [(r, t["events"]) for r, t in enumerate(table) if t["events"]]
    if sync == "event" and events:
        sync, note = "host", f"interprocess events unavailable ({events[0][1]} on rank {events[0][0]}): host syncs"
    return CudaIpcTransport(comm, comm.mpi_comm.Dup(), sync), note

"""NCCL as a Communicator backend: device buffers move by NCCL's send/recv, host buffers by the MPI
communicator it was started from, so the hand-written collectives run unchanged on NCCL's
point-to-point calls, beside NCCL's own all-reduce (nccl_all_reduce) on the same buffers.

Start-up, as ncclCommInitRank wants it: every rank first checks (over MPI) that NCCL is there and
that no two ranks share a GPU (NCCL refuses that), then rank 0 draws the 128-byte unique id and
broadcasts it. Sends and receives posted together (a sendrecv: one ring step) are issued as one
group (ncclGroupStart / ncclGroupEnd) on the current CUDA stream, so two ranks sending to each other
cannot deadlock; a request completes when an event recorded after its group has passed. Every
collective runs on the communicator's progress thread, so NCCL sees each rank's calls in program
order whether they were asynchronous or not (the API of cupy.cuda.nccl: cupy_backends/cuda/libs/
nccl.pyx at v14.2.0). Cost: NCCL's own, alpha + N·b·beta per message; the ring all-reduce moves
2(p-1)/p·N·b bytes per rank, as NCCL's ring does.
"""
import threading

import numpy as np

from .. import backend
from .collectives import broadcast
from .rings import ring_all_gather
from .communicator import Communicator
from .errors import Unavailable
from .gpu_places import gpu_place, shared_gpus
from .guard import wrap
from .wire import Request, Transport

NCCL_UINT8 = 1
NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
               "float32": 7, "float64": 8, "bfloat16": 9}
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "mean": 4}       # mean: ncclAvg (NCCL >= 2.10)


class NCCLUnavailable(Unavailable):
    """NCCL cannot run here: no NCCL library, or two ranks on one GPU."""


def nccl_module():
    """cupy.cuda.nccl, or NCCLUnavailable saying why not."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise NCCLUnavailable(f"backend 'nccl' needs CuPy's NCCL binding (cupy.cuda.nccl): {e}") from None
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise NCCLUnavailable("backend 'nccl': CuPy found no NCCL library (cupy.cuda.nccl.available is False); "
                              "install NCCL for this CUDA (e.g. the nvidia-nccl wheel) or use backend 'mpi'")
    return nccl


class _NcclRequest(Request):
    def __init__(self, transport, buf, peer, kind):
        super().__init__(peer, kind)
        self.transport, self.target, self.event = transport, buf, None

    def test(self):
        if self.event is None:
            self.transport.flush()
        return self.event.done


class NCCLTransport(Transport):
    """Device buffers by NCCL's send / recv. Posted calls wait until a request is tested; then every
    call posted so far goes out as one NCCL group on the current stream (a sendrecv cannot deadlock)."""

    name = "nccl"

    def __init__(self, comm):
        super().__init__(comm)
        self.pending = []

    def isend(self, buf, dest, tag):
        return self._post(buf, dest, "send to")

    def irecv(self, buf, source, tag):
        return self._post(buf, source, "recv from")

    def _post(self, buf, peer, kind):
        request = _NcclRequest(self, buf, peer, kind)
        with self.comm.lock:
            self.pending.append(request)
        return request

    def flush(self):
        """Issue every posted send and receive as one NCCL group on the current stream."""
        comm = self.comm
        with comm.lock:
            ops, self.pending = self.pending, []
            if not ops:
                return
            stream = comm.cupy.cuda.get_current_stream()
            comm.nccl_module.groupStart()
            try:
                for r in ops:
                    call = comm.nccl.send if r.kind == "send to" else comm.nccl.recv
                    call(r.target.data.ptr, r.target.nbytes, NCCL_UINT8, r.peer, stream.ptr)
            finally:
                comm.nccl_module.groupEnd()
            event = comm.cupy.cuda.Event(disable_timing=True)
            event.record(stream)
            for r in ops:
                r.event = event
                if r.kind == "recv from":
                    r.received = r.target.nbytes      # NCCL has no sizes to report: the bytes asked for


class NCCLCommunicator(Communicator):
    """``NCCLCommunicator(bootstrap)``: the ranks of ``bootstrap`` (an MPICommunicator, or any
    Communicator) on NCCL; collective. Raises NCCLUnavailable on every rank when NCCL cannot run."""

    backend_name = "nccl"
    transport_note = ""

    def __init__(self, bootstrap):
        options = bootstrap._options() if hasattr(bootstrap, "_options") else {}
        # its own name in the flight records (its sequence numbers are not the bootstrap's)
        super().__init__(bootstrap.rank, bootstrap.size, bootstrap.timeout, uid=f"nccl:{bootstrap.uid}",
                         members=bootstrap.members, **{k: v for k, v in options.items() if k == "comm_timeout"})
        wrap(self, **{k: v for k, v in options.items() if k != "comm_timeout"})
        self.bootstrap = bootstrap
        self.world_size = getattr(bootstrap, "world_size", bootstrap.size)
        try:
            cupy = self.cupy = backend._import_cupy()
        except RuntimeError as e:                    # no CuPy: the same on every rank
            raise NCCLUnavailable(f"backend 'nccl' moves device buffers by CuPy's NCCL binding: {e}") from None
        self.device = cupy.cuda.runtime.getDevice()
        try:
            nccl, problem = nccl_module(), None
        except NCCLUnavailable as e:
            nccl, problem = None, e
        self._check_ranks(problem)
        uid = np.zeros(128, np.uint8)
        if self.rank == 0:
            uid[:] = np.frombuffer(_id_bytes(nccl.get_unique_id()), np.uint8)
        broadcast(bootstrap, uid, root=0)
        self.nccl_module = nccl
        self.nccl = nccl.NcclCommunicator(self.size, uid.tobytes(), self.rank)
        self.lock = threading.Lock()
        self.transport = NCCLTransport(self)

    def _check_ranks(self, problem):
        """Every rank learns whether every rank has NCCL and its own GPU, and all raise alike."""
        mine = np.array([problem is None, *gpu_place()], np.int64)
        table = ring_all_gather(self.bootstrap, mine, total=4 * self.size).reshape(self.size, 4)
        missing = [r for r in range(self.size) if not table[r, 0]]
        if missing:
            raise NCCLUnavailable(f"[rank {self.rank}] NCCL cannot start: rank(s) {missing} have no NCCL"
                                  + (f" ({problem})" if problem else ""))
        shared = shared_gpus([tuple(int(v) for v in row[1:]) for row in table])
        if shared:
            ranks, device = shared[0]
            raise NCCLUnavailable(
                f"[rank {self.rank}] NCCL needs one GPU per rank, and ranks {ranks} share GPU cuda:{device} of one "
                "node (NCCL refuses two ranks on one GPU). Use backend 'mpi': its cuda-ipc transport moves device "
                "buffers between ranks that share a GPU")

    # ---- the backend's primitives: device arrays by NCCL, host arrays by the bootstrap
    def _isend(self, buf, dest, tag):
        if not backend.is_device_array(buf):
            return self.bootstrap._isend(buf, dest, tag)
        return self.transport.isend(buf, dest, tag)

    def _irecv(self, buf, source, tag):
        if not backend.is_device_array(buf):
            return self.bootstrap._irecv(buf, source, tag)
        return self.transport.irecv(buf, source, tag)

    def _split(self, color, key):
        return NCCLCommunicator(self.bootstrap.split(color, key))

    def _idle(self, seconds):
        self.bootstrap._idle(seconds)

    def _snapshots(self, world_ranks, timeout):          # the flight records travel over the bootstrap's channel
        return self.bootstrap._snapshots(world_ranks, timeout)

    def _wait_for_reporter(self, reporter, seconds):
        self.bootstrap._wait_for_reporter(reporter, seconds)

    def abort(self, code=1):
        self.nccl.abort()
        self.bootstrap.abort(code)

    # ---- program order: every collective on the progress thread (its device and stream; never run by a waiter)
    steal_queued = False

    def _on_progress_thread(self):
        progress = getattr(self, "_progress", None)
        return progress is not None and threading.current_thread() is progress._thread

    def run_collective(self, *args):
        if self._on_progress_thread():
            return super().run_collective(*args)
        return self.submit(args[0], self._on_device, super().run_collective, args).wait()

    def _on_device(self, fn, args):
        with self.cupy.cuda.Device(self.device):
            return fn(*args)

    def submit(self, name, fn, *args):
        if fn == self.run_collective:       # an asynchronous collective: on this rank's GPU as well
            return super().submit(name, self._on_device, super().run_collective, args)
        return super().submit(name, fn, *args)

    # ---- NCCL's own collectives: the anchor
    def nccl_all_reduce(self, x, op="sum", out=None):
        """NCCL's all-reduce of device array ``x`` (its own ring or tree), on the current stream;
        returns ``out`` (a new array if None). Counted as one call; NCCL does not report its bytes."""
        if x.dtype.name not in NCCL_DTYPES or op not in NCCL_OPS:
            raise ValueError(f"nccl_all_reduce: {x.dtype} / op {op!r} is not one NCCL reduces")
        out = self.cupy.empty_like(x) if out is None else out
        if not self._on_progress_thread():          # in program order with the queued collectives
            return self.submit("nccl_all_reduce", self._on_device, self.nccl_all_reduce, (x, op, out)).wait()
        stream = self.cupy.cuda.get_current_stream()
        with self.lock:
            self.nccl.allReduce(x.data.ptr, out.data.ptr, x.size, NCCL_DTYPES[x.dtype.name], NCCL_OPS[op], stream.ptr)
        self.stats.record_call("nccl_all_reduce")
        return out


def _id_bytes(uid):
    """CuPy 14 returns the unique id as bytes; older versions as a tuple of 128 (signed) chars."""
    return uid if isinstance(uid, bytes) else bytes((int(c) + 256) % 256 for c in uid)

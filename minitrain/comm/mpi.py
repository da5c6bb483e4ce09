"""MPICommunicator: the Communicator over MPI.

Host arrays move by the host transport (host.py: mpi4py's buffer API, never pickle), device arrays by
the communicator's device transport (transport.py chooses: CUDA-aware MPI, CUDA IPC on one node, else
pinned staging); the counting, the receive contract and the timeouts sit above them (communicator.py),
the flight records and the reports around (guard.py; the watchdog answers for this rank out of band).
init() is the entry point for jobs: it checks that the launcher and the MPI library belong
together, wraps COMM_WORLD, caps BLAS threads per rank, starts the death watch, and installs the
hook that turns an uncaught exception on any rank into "[rank r] traceback" and an MPI Abort.
"""
import atexit
import os
import random as _random
import socket
import sys
import tempfile
import threading
import time
import traceback
import zlib

import numpy as np

from .. import backend
from .collectives import split_table
from .communicator import DEFAULT_COMM_TIMEOUT, Communicator
from .errors import CollectiveTimeout, CommError
from .flight_recorder import FlightRecorder
from .guard import wrap
from .host import HostTransport, _mpi, cuda_aware  # noqa: F401  (cuda_aware: this module's name too)
from .launcher import check_launch
from .reports import prefixed
from .transport import default_transport

ABORT_GRACE_S = 0.5
ABORT_WAIT_S = 2 * ABORT_GRACE_S + 2.0     # how long a rank waits for another's abort to end it


class _Session:
    """One per process, like COMM_WORLD itself: the flight recorder, the watchdog on a duplicate
    of the world (the out-of-band channel) and the exit handshake."""

    def __init__(self, world, timeout):
        self.world, self.rank, self.size = world, world.Get_rank(), world.Get_size()
        self.recorder = FlightRecorder(self.rank)
        self.watchdog = None
        if self.size > 1:
            from .watchdog import Watchdog
            self.watchdog = Watchdog(timed_dup(world, timeout), self.recorder)
        self.timeout = timeout
        atexit.register(self.close)

    def close(self):
        """At exit (before mpi4py's MPI_Finalize): this rank has left the script."""
        if _mpi().Is_finalized():
            return
        detail = ""
        if getattr(sys, "last_value", None) is not None:
            detail = f"after an uncaught {type(sys.last_value).__name__}: {sys.last_value}"
        if self.recorder.status == "running":
            self.recorder.set_status("finished", detail)
        if self.watchdog is not None:
            self.watchdog.close(self.timeout)
            if self.recorder.abort_notice is not None and self.recorder.status == "finished":
                # another rank is ending the job with its own report: leaving now (status 0) raced its
                # MPI_Abort under load, and the launcher then reported 0 for the whole job (2 runs in ~40 of
                # tests/test_faults.py's skip_last beside two busy processes). Wait for the abort to end
                # this process too; if it never comes, leave without MPI_Finalize, so the job fails.
                time.sleep(ABORT_WAIT_S)
                os._exit(1)


_SESSION = None


def timed_dup(mpi_comm, timeout):
    """MPI_Comm_idup, waited for with a bound: a rank that never calls init is named, not waited for."""
    dup, request = mpi_comm.Idup()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"[rank {mpi_comm.Get_rank()}] not every rank created the world communicator "
                                    f"(minitrain.comm.init / MPICommunicator()) within {timeout:g} s")
        time.sleep(1e-3)
    return dup


def session(timeout=3 * DEFAULT_COMM_TIMEOUT):
    global _SESSION
    if _SESSION is None:
        _SESSION = _Session(_mpi().COMM_WORLD, timeout)
    return _SESSION


_TRANSPORT_LOCK = threading.Lock()


class MPICommunicator(Communicator):
    """MPICommunicator(mpi_comm=None, timeout=None, *, comm_timeout=10.0, check_collectives=True):
    COMM_WORLD by default (timeout, comm_timeout: Communicator's; the others guard.wrap's)."""

    #: False only to measure what the receive-size check costs (scripts/bench_checks.py)
    verify_sizes = True

    def __init__(self, mpi_comm=None, timeout=None, *, comm_timeout=DEFAULT_COMM_TIMEOUT, check_collectives=True,
                 recorder=None, uid=None, members=None, guard=True):
        MPI = _mpi()
        world = MPI.COMM_WORLD
        self.mpi_comm = world if mpi_comm is None else mpi_comm
        is_world = self.mpi_comm == world or MPI.Comm.Compare(self.mpi_comm, world) == MPI.IDENT
        if members is None:
            members = (list(range(self.mpi_comm.Get_size())) if is_world else
                       MPI.Group.Translate_ranks(self.mpi_comm.Get_group(), list(range(self.mpi_comm.Get_size())),
                                                 world.Get_group()))
        # first: it refuses a timeout that is not a positive number, which the session's start-up waits with
        super().__init__(self.mpi_comm.Get_rank(), self.mpi_comm.Get_size(), timeout, comm_timeout=comm_timeout,
                         uid=uid or ("world" if is_world else f"mpi{members}"), members=members)
        self.session = session(self.timeout) if (is_world or _SESSION is not None) else None
        if recorder is None:
            recorder = self.session.recorder if self.session else FlightRecorder(world.Get_rank())
        wrap(self, recorder, check_collectives, guard)
        self.world_size = world.Get_size()
        self.host = HostTransport(self)              # host arrays; the device transports send by it too

    backend_name = "mpi"
    #: how device arrays move (transport.py): comm.init() negotiates it; otherwise the default
    transport = None
    transport_note = ""

    def device_transport(self):
        if self.transport is None:
            with _TRANSPORT_LOCK:                      # the progress thread may ask at the same time
                if self.transport is None:
                    self.transport = default_transport(self)
        return self.transport

    def _isend(self, buf, dest, tag):
        return (self.device_transport() if backend.is_device_array(buf) else self.host).isend(buf, dest, tag)

    def _irecv(self, buf, source, tag):
        return (self.device_transport() if backend.is_device_array(buf) else self.host).irecv(buf, source, tag)

    def _split(self, color, key):
        # a timed all-gather first: every rank has arrived, so MPI's blocking Split cannot hang
        members, _, uid = split_table(self, color, key)
        child = MPICommunicator(self.mpi_comm.Split(color, key), timeout=self.timeout, uid=uid, members=members,
                                **self._options())
        if self.transport is not None:                 # the same transport (collective over the child)
            child.transport, child.transport_note = self.transport.split(child), self.transport_note
        return child

    def _snapshots(self, world_ranks, timeout):
        if self.session is None or self.session.watchdog is None:
            return {self.world_rank: self.recorder.snapshot()}
        return self.session.watchdog.query(list(world_ranks), timeout)

    def _wait_for_reporter(self, reporter, seconds):
        if self.session is None or self.session.watchdog is None:
            return
        recorder = self.recorder
        self.session.watchdog.wait_for(lambda: recorder.abort_notice is not None or reporter in recorder.finished_peers,
                                       seconds)
        if recorder.abort_notice is not None:          # the job is ending: let the launcher do it
            self.session.watchdog.wait_for(lambda: False, ABORT_WAIT_S)

    def abort(self, code=1):
        """Stop every rank of the job. What this rank wrote gets ABORT_GRACE_S to reach the launcher
        first (without it, under load, the job died and its message was lost: seen in CI)."""
        announce_abort(self, f"abort({code})")
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        _mpi().COMM_WORLD.Abort(code)


def announce_abort(comm, reason):
    """Mark this rank as reporting its own error (the death watch and the others stay quiet)."""
    comm.recorder.set_status("aborting", reason)
    if comm.session is not None and comm.session.watchdog is not None:
        comm.session.watchdog.announce_abort(reason)


def install_excepthook(comm):
    """An uncaught exception prints ``[rank r]``, its traceback and this rank's last calls, then
    aborts every rank. The text goes out in one unbuffered write, and the launcher gets
    ABORT_GRACE_S to forward it before MPI_Abort tears the job down (seen once under load: the
    abort won the race and the traceback never reached the terminal)."""
    rank = comm.world_rank

    def hook(exc_type, exc, tb):
        text = format_exception(exc_type, exc, tb)
        if "flight recorder report" not in text:
            text += "\nflight recorder (this rank's last calls, newest last):\n" + comm.recorder.format(last=4)
        try:
            announce_abort(comm, f"{exc_type.__name__}: {exc}".splitlines()[0][:300])
            sys.stdout.flush()
            os.write(2, (prefixed(rank, text) + "\n").encode(errors="replace"))
        finally:
            time.sleep(ABORT_GRACE_S)
            _mpi().COMM_WORLD.Abort(1)
    sys.excepthook = hook


def format_exception(exc_type, exc, tb):
    """The traceback; for communication errors without the frames inside minitrain.comm (the
    report says where: the user's frames say which line called)."""
    te = traceback.TracebackException(exc_type, exc, tb)
    if isinstance(exc, CommError):
        here = os.path.dirname(os.path.abspath(__file__))
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not os.path.abspath(f.filename).startswith(here + os.sep)])
    return "".join(te.format()).rstrip()


# ---------------------------------------------------------------- the job's entry point
def _start_death_watch(world):
    """Shared-memory slots for the ranks on this node and one watcher process (death_watch.py).
    Its few collectives run on a duplicate of the world ("init"): the job's own calls start at #0."""
    from . import death_watch
    from .rings import ring_all_gather
    if world.size == 1 or not hasattr(os, "pidfd_open") or world.recorder.mirror is not None:
        return                                       # (a second init() in this process: already watched)
    comm = MPICommunicator(timed_dup(world.mpi_comm, world.timeout), world.timeout, uid="init",
                           comm_timeout=world.comm_timeout, check_collectives=world.check_collectives,
                           recorder=world.recorder, members=world.members)
    host = zlib.crc32(socket.gethostname().encode())
    token = _random.getrandbits(48)
    table = ring_all_gather(comm, np.array([host, os.getpid(), token], np.int64),
                            total=3 * comm.size).reshape(comm.size, 3)
    local = [r for r in range(comm.size) if table[r, 0] == host]
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(shm, f"minitrain-{int(table[0, 2]):012x}-{host:08x}")
    slot = death_watch.Slot(path, local.index(comm.rank), len(local))
    world.recorder.mirror = slot
    comm.barrier()                                   # every local rank has the file mapped
    if comm.rank == local[0]:
        death_watch.start(path, local, [int(table[r, 1]) for r in local], list(range(len(local))))
        slot.wait_for_watcher(10.0)
    comm.barrier()                                   # from here on, deaths are seen in order


def init(timeout=None, limit_threads=True, *, comm_timeout=DEFAULT_COMM_TIMEOUT, check_collectives=True):
    """Entry point of an MPI job: checks the launcher against the MPI library, COMM_WORLD as a
    Communicator, BLAS threads capped to the rank's share of the cores and freed host memory held
    for the next step (``limit_threads``), the death watch, and the
    abort-on-error hook installed, and, on the GPU, this rank's device chosen: GPU
    ``local_rank % device_count`` (the launcher's local rank, so ranks on one node spread over its
    GPUs, and share them round-robin when there are more ranks than GPUs). ``comm_timeout``: the
    stall threshold (s); ``timeout``: the hard limit of any wait (default 3 x comm_timeout);
    ``check_collectives``: compare every collective's arguments across ranks before it moves data."""
    check_launch()
    comm = MPICommunicator(timeout=timeout, comm_timeout=comm_timeout, check_collectives=check_collectives)
    if backend.get_device() == "cuda":
        backend.use_gpu(backend.local_rank() % backend.gpu_count())
    if limit_threads:
        backend.limit_blas_threads()
        backend.hold_host_memory()
    install_excepthook(comm)
    _start_death_watch(comm)
    return comm

"""Communicator: the only way bytes cross ranks. Point-to-point calls, counted, checked, hang-proof.

Three backends implement the same primitives (_isend, _irecv, _split, _idle, _snapshots, abort):
MPICommunicator (mpi4py's buffer API, mpi.py), NCCLCommunicator (NCCL's send/recv, nccl.py) and
ThreadWorld (ranks as threads, local.py). A backend moves raw bytes under a *wire tag* and reports,
when a receive completes, how many bytes arrived (MPI: the status's count); everything above is shared
and written once, here and in the modules beside it (stats.py: the counters; headers.py: the header
check; reports.py: the mismatch and stall reports; flight_recorder.py):

* send/recv/sendrecv/isend/irecv on contiguous numpy (or cupy) arrays. The contract: a receive
  whose size or dtype differs from the sender's raises CommError naming both ranks, the call
  (collective and sequence number, or the p2p tag) and both sizes. Sizes are checked on completion
  (free: MPI's status); the dtype travels in the wire tag (logical tag * 16 + dtype code), so a
  message of another dtype never matches, and the stalled wait's flight recorder report names both;
* stats: bytes and messages sent/received, in total and per collective name;
* waiting: requests are polled with test(): yielding the core (sched_yield) for the first
  10 ms, then sleeping with a growing back-off (measured: spinning made a 4 MiB ring all-reduce at
  4 ranks on 2 cores 5x slower; time.sleep(0) made 1 KiB sendrecv 3x slower than sched_yield).
  A wait longer than comm_timeout (the stall threshold, default 10 s) asks every rank's flight
  recorder what it is doing (flight_recorder.py, reports.py): a rank at another call ends the job at
  once, a slow one is named in a warning; a wait longer than timeout (default 3 x comm_timeout)
  raises CollectiveTimeout with the same report. The CPU time a thread spends polling is counted
  (waiting_cpu_seconds): the jobs' step timer leaves it out of a step's own work;
* collective bookkeeping: each collective takes the next sequence number, which (with a few bits of
  its name) becomes its message tag, so asynchronous and blocking collectives never exchange each
  other's messages; with check_collectives (on by default) every collective first compares its
  header with the ring neighbour's (headers.py) and raises CollectiveMismatchError naming the
  ranks that disagree, before a byte of data moves.
"""
import os
import threading
import time
import zlib

import numpy as np

from .. import trace
from .flight_recorder import FlightRecorder, call_name
from .stats import CommStats

USER_TAG_LIMIT = 1 << 15          # p2p tags a user may choose: 0 .. 32767
COLLECTIVE_TAG_SPAN = 1 << 12     # collective sequence numbers wrap here (in flight at once: far fewer)
NAME_TAG_SLOTS = 16               # ... times a few bits of the collective's name
DTYPE_SLOTS = 16                  # wire tag = logical tag * 16 + dtype code: < 2^21, under every MPI's TAG_UB
YIELD_WINDOW_S = 10e-3            # poll with sched_yield this long, then sleep (measured: see docstring)
MAX_SLEEP_S = 1e-3
DEFAULT_COMM_TIMEOUT = 10.0       # the stall threshold, seconds
HARD_TIMEOUT_FACTOR = 3           # timeout=None means 3 x comm_timeout
SNAPSHOT_TIMEOUT_S = 3.0          # how long a stalled rank waits for the others' flight records


class CommError(RuntimeError):
    """A communication call was used wrongly (bad peer, bad buffer, size or dtype mismatch)."""


class CollectiveTimeout(CommError):
    """A wait ran past the hard timeout: some peer never answered."""


class CollectiveMismatchError(CommError):
    """Ranks called different collectives, or the same one with different arguments."""


class RankFailedError(CommError):
    """Another rank failed, so this one stopped waiting for it."""


_waiting = threading.local()


def waiting_cpu_seconds():
    """CPU seconds this thread has spent so far polling in ``wait_all`` (test() and sched_yield): the part of
    a step's CPU time that other jobs on a shared machine distort most (a thread that yields is handed the
    core back again and again while its peer waits for one). The jobs report a step's CPU time without it."""
    return getattr(_waiting, "cpu", 0.0)


class MessageTruncated(Exception):
    """Raised by a transport's ``test()``: the incoming message is longer than the buffer."""


_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint64", "uint32", "uint16", "uint8", "bool", "complex64", "complex128")
_DTYPE_CODE = {}


def dtype_code(dtype):
    """0..15: the dtype's slot in the wire tag (15: any other dtype)."""
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        name = np.dtype(dtype).name
        code = _DTYPE_CODE[dtype] = _DTYPE_NAMES.index(name) if name in _DTYPE_NAMES else DTYPE_SLOTS - 1
    return code


def wire_tag(tag, dtype):
    return tag * DTYPE_SLOTS + dtype_code(dtype)


class Request:
    """A pending send or receive. Transports implement ``test()`` and set ``received`` (bytes that
    arrived) when a receive completes; the Communicator fills in ``buf``, ``tag`` and ``record``."""

    received = None
    buf = tag = record = None

    def __init__(self, peer, kind):
        self.peer, self.kind = peer, kind

    def test(self):
        raise NotImplementedError

    def cancel(self):
        """Withdraw a receive that will not be waited for (a transport that posts receives overrides)."""

    def reduce_on_arrival(self, own, op):
        """Ask a pending receive to arrive as ``recvbuf = message (op) own`` (a reduce-scatter step).
        True if the transport does it (CUDA IPC: in the kernel that reads the peer's memory); False
        (here): the caller combines after the wait."""
        return False


def _as_buffer(a, what):
    if not hasattr(a, "nbytes"):
        raise CommError(f"{what}: expected a numpy or cupy array, got {type(a).__name__}")
    if not (a.flags.c_contiguous or a.size == 0):
        raise CommError(f"{what}: buffer of shape {a.shape} is not contiguous (use ascontiguousarray)")
    return a


class Communicator:
    """``timeout``: the hard limit of any wait (seconds; None: 3 x comm_timeout). ``comm_timeout``:
    the stall threshold after which a waiting rank compares flight records with the others.
    ``check_collectives``: compare every collective's header across ranks before it moves data."""

    def __init__(self, rank, size, timeout=None, *, comm_timeout=DEFAULT_COMM_TIMEOUT, check_collectives=True,
                 recorder=None, uid="world", members=None):
        if not comm_timeout > 0:
            raise ValueError(f"comm_timeout must be a positive number of seconds, got {comm_timeout!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.rank, self.size = rank, size
        self.comm_timeout = float(comm_timeout)
        self.timeout = HARD_TIMEOUT_FACTOR * self.comm_timeout if timeout is None else float(timeout)
        self.check_collectives = bool(check_collectives)
        self.members = list(range(size)) if members is None else list(members)   # world ranks
        self.world_rank = self.members[rank]
        self.uid = uid                            # the same string on every member (flight records)
        self.recorder = FlightRecorder(self.world_rank) if recorder is None else recorder
        self.stats = CommStats()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._local = threading.local()           # the collective running on this thread
        self._progress = None
        self._progress_lock = threading.Lock()
        self._splits = 0

    def _options(self):
        return dict(comm_timeout=self.comm_timeout, check_collectives=self.check_collectives, recorder=self.recorder)

    # ---- the transport's primitives
    def _isend(self, buf, dest, tag):
        raise NotImplementedError

    def _irecv(self, buf, source, tag):
        raise NotImplementedError

    def _split(self, color, key):
        raise NotImplementedError

    def _idle(self, seconds):
        time.sleep(seconds)

    def _snapshots(self, world_ranks, timeout):
        """world rank -> flight recorder snapshot (None: no answer) of every rank in ``world_ranks``."""
        return {self.world_rank: self.recorder.snapshot()}

    def _wait_for_reporter(self, reporter, seconds):
        """Another rank reports this fault: give it ``seconds`` to end the job before raising too."""
        time.sleep(min(seconds, 1.0))

    def abort(self, code=1):
        raise NotImplementedError

    # ---- point-to-point
    def _check_peer(self, peer, what):
        if not 0 <= peer < self.size:
            raise CommError(f"[rank {self.rank}] {what}: peer {peer} is not in a world of size {self.size}")

    def _call(self):
        return getattr(self._local, "call", None)

    def _post(self, buf, peer, tag, kind):
        """Shared by isend / irecv: check, count, record (outside collectives), hand to the transport."""
        self._check_peer(peer, kind)
        buf = _as_buffer(buf, f"[rank {self.rank}] {kind} {'to' if kind == 'send' else 'from'} {peer}")
        call = self._call()
        record = None
        if call is None:
            if not (0 <= tag < USER_TAG_LIMIT):
                raise CommError(f"[rank {self.rank}] {kind}: tag {tag} is outside 0..{USER_TAG_LIMIT - 1} "
                                "(tags above are the collectives')")
            record = self.recorder.open(self.uid, -1, kind, tuple(buf.shape), buf.dtype.name, buf.nbytes,
                                        peer=self.members[peer], tag=tag)
        apart = getattr(self._local, "count_as", None)
        self.stats.record(apart or ("p2p" if call is None else call.name), buf.nbytes,
                          "sent" if kind == "send" else "received", total=apart is None)
        transport = self._isend if kind == "send" else self._irecv
        request = transport(buf, peer, wire_tag(tag, buf.dtype))
        request.buf, request.tag, request.record = buf, tag, record
        return request

    def isend(self, buf, dest, tag=0):
        return self._post(buf, dest, tag, "send")

    def irecv(self, buf, source, tag=0):
        return self._post(buf, source, tag, "recv")

    def send(self, buf, dest, tag=0):
        self.wait_all([self.isend(buf, dest, tag)], f"send to rank {dest}")

    def recv(self, buf, source, tag=0):
        """Receive into ``buf`` (its size and dtype must be the message's) and return it."""
        self.wait_all([self.irecv(buf, source, tag)], f"recv from rank {source}")
        return buf

    def sendrecv(self, sendbuf, dest, recvbuf, source, sendtag=0, recvtag=None):
        """Send to ``dest`` and receive from ``source`` at once (a ring step)."""
        recv = self.irecv(recvbuf, source, sendtag if recvtag is None else recvtag)
        send = self.isend(sendbuf, dest, sendtag)
        self.wait_all([recv, send], f"sendrecv (to rank {dest}, from rank {source})")
        return recvbuf

    # ---- waiting
    def wait_all(self, requests, what="wait"):
        """Poll until every request completes: yield the core at first, then sleep with back-off.
        Past ``comm_timeout`` the flight records of every rank are compared (a mismatch raises at
        once); past ``timeout`` raises CollectiveTimeout naming the ranks that never answered. The
        thread's CPU time spent polling is added to ``waiting_cpu_seconds()``."""
        pending, marked, failed, cpu = requests, None, True, None
        try:
            pending = [r for r in pending if not self._test(r, what)]
            if not pending:
                failed = False
                return
            start, cpu = time.monotonic(), time.thread_time()
            sleep, stalled = 0.0, False
            while True:
                pending = [r for r in pending if not self._test(r, what)]
                if not pending:
                    failed = False
                    return
                elapsed = time.monotonic() - start
                if elapsed < YIELD_WINDOW_S:
                    os.sched_yield()
                    continue
                if marked is None:                     # a long wait: tell the flight recorder on whom
                    marked = self._mark_waiting(pending, start)
                if elapsed > self.timeout:
                    self._stalled(pending, what, elapsed, hard=True)
                if elapsed > self.comm_timeout and not stalled:
                    stalled = True
                    self._stalled(pending, what, elapsed, hard=False)
                sleep = min(max(2 * sleep, 5e-5), MAX_SLEEP_S)
                self._idle(sleep)
        finally:
            if cpu is not None:
                _waiting.cpu = getattr(_waiting, "cpu", 0.0) + time.thread_time() - cpu
            for record in marked or ():
                record.waiting_for = None
            if failed:                  # an error (or a stall) ends this wait: nobody waits for these any more
                for r in pending:
                    self._close(r, "failed")

    def _test(self, request, what):
        try:
            done = request.test()
            if done and request.received is not None and request.received != request.buf.nbytes:
                raise self._size_error(request, request.received)
        except BaseException as e:
            self._close(request, "failed")
            if isinstance(e, MessageTruncated):
                raise self._size_error(request, None) from None
            if isinstance(e, CommError) or not isinstance(e, Exception):
                raise
            call = self._call()     # the transport's own error
            raise CommError(f"[rank {self.rank}] {call_name(call.as_dict()) + ': ' if call else ''}{what} failed "
                            f"({request.kind} rank {request.peer}): {e}") from e
        if done:
            self._close(request, "done")
        return done

    def _close(self, request, state):
        """Close a point-to-point call's flight record (done, or failed: no longer waited for, and
        a pending receive withdrawn)."""
        if state == "failed":
            request.cancel()
        if request.record is not None:
            self.recorder.close(request.record, state)
            request.record = None

    def _mark_waiting(self, pending, start):
        since = start
        peers = sorted({self.members[r.peer] for r in pending})
        call = self._call()
        records = [call] if call is not None else [r.record for r in pending if r.record is not None]
        for record in records:
            record.waiting_for, record.wait_since = peers, since
        return records

    def _stalled(self, pending, what, elapsed, hard):
        """Past comm_timeout (or the hard timeout): compare flight records (reports.py)."""
        stalled(self, pending, what, elapsed, hard)

    def _raise_once(self, error, reporter):
        """One rank reports a fault; the others give it time to end the job (or to raise, on
        ThreadWorld) before they raise too, so a user reads one report, not p of them."""
        if reporter != self.world_rank:
            self._wait_for_reporter(reporter, self.comm_timeout + 2.0)
        raise error

    def _size_error(self, request, received, their_dtype=None):
        """The receive contract's error (reports.py)."""
        return size_error(self, request, received, their_dtype)

    def barrier(self):
        """Dissemination barrier (Hensgen et al. 1988): ceil(log2 p) rounds of empty messages."""
        self.launch("barrier", _barrier_body, (), False, {}, 0)

    def split(self, color, key=None):
        """Sub-communicator of the ranks that pass the same ``color``, ordered by ``key`` (then rank)."""
        self._splits += 1
        return self._split(int(color), self.rank if key is None else int(key))

    def _split_table(self, color, key):
        """Every rank's (color, key) through one timed all-gather: no rank can wait for a split
        that another never calls. Returns (this rank's new members in world ranks, new rank, uid)."""
        from .collectives import ring_all_gather
        table = ring_all_gather(self, np.array([color, key], np.int64), total=2 * self.size).reshape(self.size, 2)
        members = sorted((int(k), r) for r, (c, k) in enumerate(table) if c == color)
        local = [r for _, r in members]
        world = [self.members[r] for r in local]
        return world, local.index(self.rank), f"{self.uid}/split{self._splits}{world}"

    # ---- collective bookkeeping
    def next_tag(self, name):
        """(sequence number, message tag) of the next collective called ``name``."""
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
        return seq, USER_TAG_LIMIT + (seq % COLLECTIVE_TAG_SPAN) * NAME_TAG_SLOTS + _name_slot(name)

    @staticmethod
    def header_tag(seq):
        """The headers of collective #seq meet whatever collective each rank called."""
        return USER_TAG_LIMIT + (seq % COLLECTIVE_TAG_SPAN) * NAME_TAG_SLOTS + NAME_TAG_SLOTS - 1

    def launch(self, name, body, args, async_op, header, nbytes):
        """Take the next sequence number now (program order, identical on every rank), open its
        flight record, then run ``body(self, tag, *args)`` here or on the progress thread."""
        seq_tag = self.next_tag(name)
        shape, dtype = header.get("shape"), header.get("dtype")
        record = self.recorder.open(self.uid, seq_tag[0], name, None if shape is None else tuple(shape),
                                    None if dtype is None else np.dtype(dtype).name, nbytes, header.get("op"),
                                    header.get("extra"), state="queued" if async_op else "running")
        if async_op:
            return self.submit(name, self.run_collective, name, seq_tag, header, nbytes, body, args, record)
        return self.run_collective(name, seq_tag, header, nbytes, body, args, record)

    def run_collective(self, name, seq_tag, header, nbytes, body, args, record):
        """Run ``body(self, tag, *args)`` as collective ``name``: its traffic is counted under the
        name, it is traced and recorded, and (check_collectives) every rank first checks that its
        neighbour calls the same thing (headers.py)."""
        seq, tag = seq_tag
        if record.state == "queued":
            self.recorder.run(record)
        previous = self._call()
        self._local.call = record
        self.stats.record_call(name)
        tracing = trace.tracer().enabled
        start = time.perf_counter() if tracing else 0.0
        try:
            if self.check_collectives and self.size > 1:
                check_header(self, record)
            result = body(self, tag, *args)
        except BaseException:
            self.recorder.close(record, "failed")
            raise
        finally:
            self._local.call = previous
            if tracing:
                trace.tracer().add(name, "comm", start, time.perf_counter(), {"bytes": nbytes, "seq": seq})
        self.recorder.close(record)
        return result

    # ---- asynchronous work
    def submit(self, name, fn, *args):
        """Queue ``fn(*args)`` on this communicator's progress thread; returns a Work named ``name``."""
        if self._progress is None:
            with self._progress_lock:
                if self._progress is None:
                    from .work import ProgressThread     # (here: work.py imports this module)
                    self._progress = ProgressThread(self)
        return self._progress.submit(name, fn, args)

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


def range_all(comm):
    """Every world rank this communicator's process can see (the members, at least)."""
    world = getattr(comm, "world_size", None)
    return list(range(world)) if world else list(comm.members)


def _barrier_body(comm, tag):
    token, incoming = np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    distance = 1
    while distance < comm.size:
        comm.sendrecv(token, (comm.rank + distance) % comm.size, incoming,
                      (comm.rank - distance) % comm.size, tag)
        distance *= 2


_SLOTS = {}


def _name_slot(name):
    slot = _SLOTS.get(name)
    if slot is None:
        slot = _SLOTS[name] = zlib.crc32(name.encode()) % (NAME_TAG_SLOTS - 1)  # last slot: headers
    return slot


from .headers import check_header  # noqa: E402  (headers.py imports this module)
from .reports import size_error, stalled  # noqa: E402  (reports.py imports this module)

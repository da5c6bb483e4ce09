"""Communicator: the only way bytes cross ranks. Point-to-point calls and the tag discipline.

Under it a backend (mpi.py, local.py, nccl.py) moves raw bytes under a wire tag (tag * 16 + dtype code: a message
of another dtype never matches); here, once for all: send / recv / sendrecv / isend / irecv, checked (a receive of
another size raises) and counted; wait_all (sched_yield, then sleep: waiting.py says why); each collective's sequence
number, whose tag no other collective uses. Around it, through one seam (comm.guard, seam.py), the guard (guard.py);
a collective runs here or on the progress thread (work.py).
"""
import os
import threading
import time
import zlib

from .errors import CollectiveTimeout, CommError, MessageTruncated, size_error
from .seam import Unguarded
from .stats import CommStats
from .waiting import MAX_SLEEP_S, YIELD_BYTES_PER_S, YIELD_WINDOW_S, _waiting
from .wire import DTYPE_SLOTS, dtype_code
from .work import Launcher

USER_TAG_LIMIT = 1 << 15          # p2p tags a user may choose: 0 .. 32767
COLLECTIVE_TAG_SPAN = 1 << 12     # collective sequence numbers wrap here (in flight at once: far fewer)
NAME_TAG_SLOTS = 16               # ... times a few bits of the name (the last slot: the guard's headers)
DEFAULT_COMM_TIMEOUT = 10.0       # the stall threshold, seconds
HARD_TIMEOUT_FACTOR = 3           # timeout=None means 3 x comm_timeout


def _check_buffer(a, what, kind):    # what(): the call's name, made only for an error (every message passes)
    if not hasattr(a, "nbytes"):
        raise CommError(f"{what()}: expected a numpy or cupy array, got {type(a).__name__}")
    if not (a.flags.c_contiguous or a.size == 0):
        raise CommError(f"{what()}: buffer of shape {a.shape} is not contiguous (use ascontiguousarray)")
    if kind == "recv" and not getattr(a.flags, "writeable", True):       # (CuPy's arrays are always writeable)
        raise CommError(f"{what()}: buffer of shape {a.shape} is read-only, and a receive writes into it")
    if a.dtype.hasobject:
        raise CommError(f"{what()}: buffer of shape {a.shape} holds Python objects, whose pointers mean nothing in "
                        f"another process")


class Communicator(Launcher):
    """``timeout``: any wait's hard limit (s; None: 3 x comm_timeout); ``comm_timeout``: the stall threshold (a guard looks)."""

    guard = Unguarded()

    def __init__(self, rank, size, timeout=None, *, comm_timeout=DEFAULT_COMM_TIMEOUT, uid="world", members=None):
        if not comm_timeout > 0:
            raise ValueError(f"comm_timeout must be a positive number of seconds, got {comm_timeout!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.rank, self.size, self.uid, self.comm_timeout = rank, size, uid, float(comm_timeout)
        self.timeout = HARD_TIMEOUT_FACTOR * self.comm_timeout if timeout is None else float(timeout)
        self.members = list(range(size)) if members is None else list(members)   # world ranks
        self.world_rank = self.members[rank]
        self.stats = CommStats()
        self._seq, self._seq_lock, self._local = 0, threading.Lock(), threading.local()
        self._progress, self._progress_lock, self._splits = None, threading.Lock(), 0

    def _options(self):                               # what a split passes on
        return dict(comm_timeout=self.comm_timeout, **self.guard.options(self))

    # ---- the backend's primitives
    def _isend(self, buf, dest, tag): raise NotImplementedError          # noqa: E704
    def _irecv(self, buf, source, tag): raise NotImplementedError        # noqa: E704
    def _split(self, color, key): raise NotImplementedError              # noqa: E704
    def _idle(self, seconds): time.sleep(seconds)                        # noqa: E704
    def abort(self, code=1): raise NotImplementedError                   # noqa: E704

    # ---- point-to-point (uid: the communicator's name, the same on every member)
    def _call(self):                                  # the collective running on this thread
        return getattr(self._local, "call", None)

    def _post(self, buf, peer, tag, kind, counted=None):
        """isend / irecv: check, count (under ``counted``, apart from the totals, if given), hand over."""
        if not 0 <= peer < self.size:
            raise CommError(f"[rank {self.rank}] {kind}: peer {peer} is not in a world of size {self.size}")
        _check_buffer(buf, lambda: f"[rank {self.rank}] {kind} {'to' if kind == 'send' else 'from'} {peer}", kind)
        call = self._call()
        if call is None and not 0 <= tag < USER_TAG_LIMIT:
            raise CommError(f"[rank {self.rank}] {kind}: tag {tag} is outside 0..{USER_TAG_LIMIT - 1} "
                            "(tags above are the collectives')")
        self.stats.record(counted or ("p2p" if call is None else call.name), buf.nbytes,
                          "sent" if kind == "send" else "received", total=counted is None)
        request = self.post_unrecorded(buf, peer, tag, kind)
        if call is None:
            self.guard.posted(self, request, kind)
        return request

    def post_unrecorded(self, buf, peer, tag, kind):
        """isend / irecv ("send" / "recv") without _post's check, count and record, for a caller that does
        them once for routes it reuses (the pipeline: messages.py says why), record_waits included."""
        request = (self._isend if kind == "send" else self._irecv)(buf, peer, tag * DTYPE_SLOTS + dtype_code(buf.dtype))
        request.buf, request.tag, request.record, request.communicator = buf, tag, None, self
        return request

    def record_waits(self, requests, kind):
        """The flight records post_unrecorded skipped, for requests about to be waited on (a stall names them)."""
        for request in requests:
            if request.record is None:
                self.guard.posted(self, request, kind)

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

    def wait_all(self, requests, what="wait", poll=None, timeout=None, withdraw=True):
        """Poll until all complete (poll: yield s, longest sleep s); past comm_timeout the guard looks, past timeout: raise."""
        pending, marked, failed, cpu, stalled = requests, None, True, None, False
        limit, (window, longest) = self.timeout if timeout is None else timeout, poll or (YIELD_WINDOW_S, MAX_SLEEP_S)
        try:
            pending = [r for r in pending if not self.test(r, what)]
            if pending:
                start, cpu, sleep = time.monotonic(), time.thread_time(), 0.0
                window = window if poll else max(window, sum(getattr(r.buf, "nbytes", 0) for r in pending) / YIELD_BYTES_PER_S)
            while pending:
                elapsed = time.monotonic() - start
                if elapsed < window:
                    os.sched_yield()
                else:
                    marked = self.guard.waiting(self, pending, start) if marked is None else marked
                    if elapsed > limit:
                        self.guard.stalled(self, pending, what, elapsed, hard=True)
                        raise CollectiveTimeout(f"[rank {self.rank}] {what} timed out after {limit:g} s; "
                                                f"no answer from rank(s) {sorted({r.peer for r in pending})}")
                    if elapsed > self.comm_timeout and not stalled:
                        stalled = True
                        self.guard.stalled(self, pending, what, elapsed, hard=False)
                    sleep = min(max(2 * sleep, 5e-5), longest)
                    self._idle(sleep)
                pending = [r for r in pending if not self.test(r, what)]
            failed = False
        finally:
            if cpu is not None:
                _waiting.cpu = getattr(_waiting, "cpu", 0.0) + time.thread_time() - cpu
            self.guard.waited(marked or ())
            for r in pending if failed and withdraw else ():   # withdrawn (withdraw=False: the caller awaits them)
                self._close(r, "failed")

    def test(self, request, what="test"):
        """Whether ``request`` is complete (MPI_Test); a receive of another size or a failure raises."""
        try:
            done = request.test()
            if done and request.received is not None and request.received != request.buf.nbytes:
                raise size_error(self, request, request.received)
        except BaseException as e:
            self._close(request, "failed")
            if isinstance(e, MessageTruncated):
                raise size_error(self, request, None) from None
            if isinstance(e, CommError) or not isinstance(e, Exception):
                raise
            call = self._call()     # the transport's own error
            raise CommError(f"[rank {self.rank}] {f'{call.name} #{call.seq}: ' if call else ''}{what} failed "
                            f"({request.kind} rank {request.peer}): {e}") from e
        if done:
            self._close(request, "done")
        return done

    def _close(self, request, state):
        if state == "failed":
            request.cancel()                # a pending receive is withdrawn
        self.guard.closed(self, request, state)

    def barrier(self):
        from .collectives import barrier
        barrier(self)

    def split(self, color, key=None):
        """Sub-communicator of the ranks that pass the same integer ``color``, ordered by ``key`` (then rank)."""
        self._splits += 1
        return self._split(color, self.rank if key is None else key)     # split_table checks both

    # ---- collectives: sequence numbers and tags
    def next_tag(self, name):
        """(sequence number, message tag) of the next collective called ``name``."""
        with self._seq_lock:
            seq, self._seq = self._seq, self._seq + 1
        name_slot = zlib.crc32(name.encode()) % (NAME_TAG_SLOTS - 1)
        return seq, USER_TAG_LIMIT + (seq % COLLECTIVE_TAG_SPAN) * NAME_TAG_SLOTS + name_slot

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

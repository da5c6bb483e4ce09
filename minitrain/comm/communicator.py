"""Communicator: the only way bytes cross ranks. Point-to-point calls, counted and hang-proof.

Two transports implement the same five primitives (_isend, _irecv, _split, _idle,
abort): MPICommunicator (mpi4py's buffer API) and ThreadWorld (ranks as threads).
Everything above is shared and written once, here:

* send/recv/sendrecv/isend/irecv on contiguous numpy (or cupy) arrays, sent as raw bytes;
* stats: bytes and messages sent/received, in total and per collective name;
* waiting: requests are polled with test(): yielding the core (sched_yield) for the
  first ~2 ms, then sleeping with a growing back-off. Measured here: pure spinning made a 4 MiB
  ring all-reduce at 4 ranks on 2 cores 5x slower; time.sleep(0) (a nanosleep, which the
  kernel's timer slack stretches to ~50 us) made 1 KiB sendrecv 3x slower than sched_yield.
  A 10 ms yield window keeps MPI progressing through a multi-MiB transfer (2 ms cost p=2 a
  quarter of its 16 MiB bandwidth) and did not slow a computing rank beside 3 waiting ones. Every wait has a timeout (MINITRAIN_TIMEOUT seconds,
  default 300) that raises CollectiveTimeout naming the operation and the silent peers;
* collective bookkeeping: each collective call takes the next sequence number, which (with a
  hash of the collective's name) becomes its message tag, so a blocking collective and an
  asynchronous one in flight never mix up their messages, and two ranks that call different
  collectives wait for each other (and time out naming each other) instead of exchanging
  mismatched bytes; with MINITRAIN_DEBUG=1 first exchanges a header (name, sequence
  number, shape, dtype, op) with every rank, raising CollectiveMismatchError on disagreement.
"""
import os
import threading
import time
import zlib

import numpy as np

from .. import trace

USER_TAG_LIMIT = 1 << 15     # p2p tags a user may choose: 0 .. 32767
COLLECTIVE_TAG_SPAN = 1 << 14    # collective sequence numbers wrap here
NAME_TAG_SLOTS = 16              # ... times a few bits of the collective's name
YIELD_WINDOW_S = 10e-3       # poll with sched_yield this long, then sleep (measured: see docstring)
MAX_SLEEP_S = 1e-3


class CommError(RuntimeError):
    """A communication call was used wrongly (bad peer, bad buffer, size mismatch)."""


class CollectiveTimeout(CommError):
    """A wait ran past MINITRAIN_TIMEOUT: some peer never answered."""


class CollectiveMismatchError(CommError):
    """Ranks called different collectives, or the same one with different arguments."""


class RankFailedError(CommError):
    """Another rank failed, so this one stopped waiting for it."""


def default_timeout():
    return float(os.environ.get("MINITRAIN_TIMEOUT", "300"))


def debug_enabled():
    return os.environ.get("MINITRAIN_DEBUG", "0") not in ("", "0", "false", "False")


class CommStats:
    """Bytes and messages, in total and per collective name ("p2p" outside collectives)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self.bytes_sent = self.bytes_received = 0
            self.messages_sent = self.messages_received = 0
            self.by_name = {}

    def _entry(self, name):
        entry = self.by_name.get(name)
        if entry is None:
            entry = self.by_name[name] = {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                                          "messages_received": 0, "calls": 0}
        return entry

    def record(self, name, nbytes, direction):
        """Count one message; ``direction`` is "sent" or "received"."""
        with self._lock:
            setattr(self, f"bytes_{direction}", getattr(self, f"bytes_{direction}") + nbytes)
            setattr(self, f"messages_{direction}", getattr(self, f"messages_{direction}") + 1)
            e = self._entry(name)
            e[f"bytes_{direction}"] += nbytes
            e[f"messages_{direction}"] += 1

    def record_call(self, name):
        with self._lock:
            self._entry(name)["calls"] += 1

    def __getitem__(self, name):
        """A copy of the counters of one collective (zeros if it never ran)."""
        with self._lock:
            entry = self.by_name.get(name)
            return dict(entry) if entry else {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                                              "messages_received": 0, "calls": 0}


class Request:
    """A pending send or receive. Transports implement ``test()``; ``peer`` and ``kind`` name it in errors."""

    def __init__(self, peer, kind):
        self.peer, self.kind = peer, kind

    def test(self):
        raise NotImplementedError


def _as_buffer(a, what):
    if not hasattr(a, "nbytes"):
        raise CommError(f"{what}: expected a numpy or cupy array, got {type(a).__name__}")
    if not (a.flags.c_contiguous or a.size == 0):
        raise CommError(f"{what}: buffer of shape {a.shape} is not contiguous (use ascontiguousarray)")
    return a


class Communicator:
    def __init__(self, rank, size, timeout=None):
        self.rank, self.size = rank, size
        self.timeout = default_timeout() if timeout is None else timeout
        self.debug = debug_enabled()
        self.stats = CommStats()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._local = threading.local()          # name of the collective running on this thread
        self._progress = None
        self._progress_lock = threading.Lock()

    # ---- the transport's primitives
    def _isend(self, buf, dest, tag):
        raise NotImplementedError

    def _irecv(self, buf, source, tag):
        raise NotImplementedError

    def _split(self, color, key):
        raise NotImplementedError

    def _idle(self, seconds):
        time.sleep(seconds)

    def abort(self, code=1):
        raise NotImplementedError

    # ---- point-to-point
    def _check_peer(self, peer, what):
        if not 0 <= peer < self.size:
            raise CommError(f"[rank {self.rank}] {what}: peer {peer} is not in a world of size {self.size}")

    def _current_name(self):
        return getattr(self._local, "name", None) or "p2p"

    def isend(self, buf, dest, tag=0):
        self._check_peer(dest, "send")
        buf = _as_buffer(buf, f"[rank {self.rank}] send to {dest}")
        self.stats.record(self._current_name(), buf.nbytes, "sent")
        return self._isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self._check_peer(source, "recv")
        buf = _as_buffer(buf, f"[rank {self.rank}] recv from {source}")
        self.stats.record(self._current_name(), buf.nbytes, "received")
        return self._irecv(buf, source, tag)

    def send(self, buf, dest, tag=0):
        self.wait_all([self.isend(buf, dest, tag)], f"send to rank {dest}")

    def recv(self, buf, source, tag=0):
        """Receive into ``buf`` (its size must be the message's) and return it."""
        self.wait_all([self.irecv(buf, source, tag)], f"recv from rank {source}")
        return buf

    def sendrecv(self, sendbuf, dest, recvbuf, source, sendtag=0, recvtag=None):
        """Send to ``dest`` and receive from ``source`` at once (a ring step)."""
        recv = self.irecv(recvbuf, source, sendtag if recvtag is None else recvtag)
        send = self.isend(sendbuf, dest, sendtag)
        self.wait_all([recv, send], f"sendrecv (to rank {dest}, from rank {source})")
        return recvbuf

    def wait_all(self, requests, what="wait"):
        """Poll until every request completes: yield the core at first, then sleep with back-off.
        Raises CollectiveTimeout naming the peers that never answered."""
        pending = [r for r in requests if not self._test(r, what)]
        if not pending:
            return
        start = time.perf_counter()
        sleep = 0.0
        while pending:
            pending = [r for r in pending if not self._test(r, what)]
            if not pending:
                return
            elapsed = time.perf_counter() - start
            if elapsed > self.timeout:
                name = getattr(self._local, "name", None)
                peers = sorted({r.peer for r in pending})
                raise CollectiveTimeout(
                    f"[rank {self.rank}] {name + ': ' if name else ''}{what} timed out after "
                    f"{self.timeout:g} s (MINITRAIN_TIMEOUT); no answer from rank(s) {peers} "
                    f"({', '.join(f'{r.kind} rank {r.peer}' for r in pending)})")
            if elapsed < YIELD_WINDOW_S:
                os.sched_yield()
            else:
                sleep = min(max(2 * sleep, 5e-5), MAX_SLEEP_S)
                self._idle(sleep)

    def _test(self, request, what):
        try:
            return request.test()
        except CommError:
            raise
        except Exception as e:     # the transport's own error (e.g. MPI "message truncated")
            name = getattr(self._local, "name", None)
            raise CommError(f"[rank {self.rank}] {name + ': ' if name else ''}{what} failed "
                            f"({request.kind} rank {request.peer}): {e}. Ranks probably called "
                            "different collectives or passed different sizes; run with "
                            "MINITRAIN_DEBUG=1 to see which") from e

    def barrier(self):
        """Dissemination barrier (Hensgen et al. 1988): ceil(log2 p) rounds of empty messages."""
        self.run_collective("barrier", self.next_tag("barrier"), None, 0, _barrier_body, ())

    def split(self, color, key=None):
        """Sub-communicator of the ranks that pass the same ``color``, ordered by ``key`` (then rank)."""
        return self._split(int(color), self.rank if key is None else int(key))

    # ---- collective bookkeeping
    def next_tag(self, name):
        """(sequence number, message tag) of the next collective called ``name``."""
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
        slot = _name_slot(name)
        return seq, USER_TAG_LIMIT + (seq % COLLECTIVE_TAG_SPAN) * NAME_TAG_SLOTS + slot

    @staticmethod
    def header_tag(seq):
        """Debug headers of collective #seq meet whatever collective each rank called."""
        return USER_TAG_LIMIT + (seq % COLLECTIVE_TAG_SPAN) * NAME_TAG_SLOTS + NAME_TAG_SLOTS - 1

    def run_collective(self, name, seq_tag, header, nbytes, body, args):
        """Run ``body(self, tag, *args)`` as collective ``name``: its traffic is counted under the
        name, it is traced, and (debug) every rank first checks that all call the same thing."""
        seq, tag = seq_tag
        previous = getattr(self._local, "name", None)
        self._local.name = name
        self.stats.record_call(name)
        tracing = trace.tracer().enabled
        start = time.perf_counter() if tracing else 0.0
        try:
            if self.debug and self.size > 1:
                self._check_header(name, seq, header or {})
            return body(self, tag, *args)
        finally:
            self._local.name = previous
            if tracing:
                trace.tracer().add(name, "comm", start, time.perf_counter(), {"bytes": nbytes, "seq": seq})

    def _check_header(self, name, seq, header):
        """Exchange (name, seq, shape, dtype, op) with every rank; raise if any disagrees."""
        mine = encode_header(name, seq, header)
        others = np.empty((self.size, mine.size), np.int64)
        others[self.rank] = mine
        tag = self.header_tag(seq)
        reqs = []
        for peer in range(self.size):
            if peer != self.rank:
                reqs.append(self._irecv(others[peer], peer, tag))
                reqs.append(self._isend(mine, peer, tag))
        self.wait_all(reqs, f"{name} #{seq}: header check")
        differ = [peer for peer in range(self.size) if not np.array_equal(others[peer], mine)]
        if differ:
            lines = [f"  rank {peer}: {describe_header(others[peer])}" for peer in range(self.size)]
            raise CollectiveMismatchError(
                f"[rank {self.rank}] collective #{seq} disagrees across ranks (rank(s) {differ} differ "
                f"from rank {self.rank}):\n" + "\n".join(lines))

    # ---- asynchronous work
    def submit(self, name, fn, *args):
        """Queue ``fn(*args)`` on this communicator's progress thread; returns a Work named ``name``."""
        from .work import ProgressThread
        with self._progress_lock:
            if self._progress is None:
                self._progress = ProgressThread(self)
        return self._progress.submit(name, fn, args)

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


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


# ---- collective headers (debug mode): fixed-size int64 arrays, comparable element by element
NAMES = {}      # code -> name, for every collective and dtype (a rank must decode what it never called)


def register_names(names):
    for name in names:
        NAMES[zlib.crc32(name.encode())] = name


def _register_dtypes():
    for dt in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
               "uint32", "uint64", "bool", "complex64", "complex128"):
        NAMES[zlib.crc32(np.dtype(dt).str.encode())] = dt
OPS = {None: 0, "sum": 1, "mean": 2, "max": 3, "min": 4}
MAX_DIMS = 6


def encode_header(name, seq, header):
    code = zlib.crc32(name.encode())
    NAMES[code] = name
    shape = header.get("shape")
    dims = [-1] * MAX_DIMS if shape is None else (list(shape) + [-2] * MAX_DIMS)[:MAX_DIMS]
    dtype = header.get("dtype")
    dcode = zlib.crc32(np.dtype(dtype).str.encode()) if dtype is not None else 0
    if dtype is not None:
        NAMES[dcode] = np.dtype(dtype).name
    extra = header.get("extra", 0)
    return np.array([code, seq, -1 if shape is None else len(shape), *dims, dcode,
                     OPS.get(header.get("op"), 9), extra], np.int64)


_register_dtypes()
register_names(["barrier"])


def describe_header(h):
    name = NAMES.get(int(h[0]), f"collective {int(h[0])}")
    ndim = int(h[2])
    shape = "any" if ndim < 0 else tuple(int(d) for d in h[3:3 + ndim])
    dtype = NAMES.get(int(h[3 + MAX_DIMS]), "?")
    op = {v: k for k, v in OPS.items()}.get(int(h[4 + MAX_DIMS]))
    return f"{name} #{int(h[1])} shape={shape} dtype={dtype} op={op} root/extra={int(h[5 + MAX_DIMS])}"

"""The flight recorder: each rank keeps its last collectives, and a stalled wait compares them.

As PyTorch's NCCL flight recorder: every collective (and every point-to-point call made outside a
collective) leaves a record: communicator, sequence number, name, shape, dtype, bytes, start time,
state (queued / running / done / failed) and, once a wait lasts, the ranks it waits for. Each rank
keeps the last capacity records in a ring (a deque: O(1) per call, ~2 us). When a wait passes
the stall threshold (comm_timeout), the waiting rank collects every member's records out of band
(ThreadWorld: directly; MPI: the watchdog thread of each rank answers on a duplicated communicator)
and flight_verdict.py names the verdict from them.
"""
import functools
import os
import socket
import threading
import time
from collections import deque

import numpy as np

from .flight_text import describe_record

STATES = ("queued", "running", "done", "failed")


@functools.lru_cache(maxsize=None)
def dtype_name(dtype):
    """np.dtype(dtype).name, looked up once per dtype: numpy computes the name in Python on every
    access (~70 us when a step's arithmetic has just evicted it from the caches; every call's record
    names its dtype)."""
    return np.dtype(dtype).name


class Record:
    """One call: a collective (``seq`` >= 0) or a point-to-point send / recv (``tag``, ``peer``)."""

    __slots__ = ("comm", "seq", "name", "shape", "dtype", "nbytes", "op", "extra", "peer", "tag",
                 "start", "end", "state", "waiting_for", "wait_since")

    def __init__(self, comm, seq, name, shape, dtype, nbytes, op, extra, peer, tag, state):
        self.comm, self.seq, self.name = comm, seq, name
        self.shape, self.dtype, self.nbytes = shape, dtype, nbytes
        self.op, self.extra, self.peer, self.tag = op, extra, peer, tag
        self.start, self.end, self.state = time.monotonic(), None, state
        self.waiting_for, self.wait_since = None, None

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}


class FlightRecorder:
    """One per rank (shared by every communicator of that rank). ``mirror``: the death watch's
    shared-memory slot, told about each call so that a rank killed by SIGKILL can still be named."""

    #: False only to measure what recording costs (scripts/bench_checks.py): the record is made (the
    #: header check reads it) but not kept, mirrored or tracked
    recording = True

    def __init__(self, rank, capacity=64):
        self.rank, self.capacity = rank, capacity
        self.records = deque(maxlen=capacity)
        self.active = {}                     # id(record) -> record, until it is done
        self.next_seq = {}                   # communicator uid -> collectives started on it
        self.status, self.detail = "running", ""
        self.mirror = None
        self.finished_peers = {}             # world rank -> its snapshot at exit (MPI: sent at exit)
        self.abort_notice = None             # (rank, reason) once some rank announced it aborts
        self.pid, self.host = os.getpid(), socket.gethostname()
        self._lock = threading.Lock()

    # ---- the hot path: two calls per collective
    def open(self, comm, seq, name, shape=None, dtype=None, nbytes=0, op=None, extra=None, peer=None,
             tag=None, state="running"):
        record = Record(comm, seq, name, shape, dtype, nbytes, op, extra, peer, tag, state)
        if not self.recording:
            return record
        self.records.append(record)
        self.active[id(record)] = record
        if seq >= 0 and (self.next_seq.get(comm, 0) <= seq):
            self.next_seq[comm] = seq + 1
        if self.mirror is not None and state == "running":
            self.mirror.begin(comm, seq, name)
        return record

    def run(self, record):
        """A queued (asynchronous) collective starts on the progress thread."""
        if not self.recording:
            return
        record.state, record.start = "running", time.monotonic()
        if self.mirror is not None:
            self.mirror.begin(record.comm, record.seq, record.name)

    def close(self, record, state="done"):
        if not self.recording:
            return
        record.state, record.end = state, time.monotonic()
        self.active.pop(id(record), None)
        if self.mirror is not None:
            self.mirror.end(state == "done")

    def set_status(self, status, detail=""):
        """running | finished (left the script) | aborting (reported its own error) | failed."""
        self.status, self.detail = status, detail
        if self.mirror is not None:
            self.mirror.set_status(status)

    # ---- reading
    def snapshot(self):
        """A plain, picklable copy: what another rank (or the report) gets."""
        with self._lock:
            records = self.records.copy()        # deque.copy holds the GIL: consistent
            active = list(self.active.values())
        seen = {id(r) for r in records}
        older = [r for r in active if id(r) not in seen]      # still running, pushed out of the ring
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "status": self.status,
                "detail": self.detail, "now": time.monotonic(), "next_seq": dict(self.next_seq),
                "records": [r.as_dict() for r in older + list(records)]}

    def format(self, last=8):
        """This rank's last calls, one line each (newest last)."""
        snap = self.snapshot()
        return "\n".join(describe_record(r, snap["now"]) for r in snap["records"][-last:]) or "(no calls yet)"

"""ThreadWorld: N ranks as threads in one process, for fast tests and notebooks.

ThreadWorld(4).run(fn) calls fn(comm) on four threads, each with its own
ThreadCommunicator (and its own memory tracker, tracer, flight recorder and random generator, so
per-rank accounting works and ranks draw the same numbers, as processes with one seed do), and
returns the four results. Messages go through one shared mailbox keyed by (group, source,
destination, tag); a send copies its buffer (so the sender may reuse it at once, as after MPI_Send
returns), a receive checks the message's size and dtype against its buffer and copies it in.
The flight records of every rank are read directly (no out-of-band channel needed). If one rank
raises, the others stop waiting within milliseconds; a rank that waits for one that has returned
from fn fails at once; run re-raises the first error with a note naming the rank, and
never waits without bound for a rank that does not return.
"""
import threading
import time
from collections import defaultdict, deque

import numpy as np

from .. import memory, random, trace
from .collectives import split_table
from .communicator import DEFAULT_COMM_TIMEOUT, HARD_TIMEOUT_FACTOR, Communicator
from .wire import DTYPE_SLOTS
from .errors import CollectiveMismatchError, CollectiveTimeout, RankFailedError, size_error
from .flight_recorder import FlightRecorder
from .flight_text import call_name
from .guard import wrap
from .wire import Request


class _SendDone(Request):
    def test(self):
        return True


class _ThreadRecv(Request):
    def __init__(self, comm, buf, source, tag):
        super().__init__(source, "recv from")
        self.comm = comm
        self.key = (comm.group_id, source, comm.rank, tag // DTYPE_SLOTS)   # dtype checked, not matched
        self.code = tag % DTYPE_SLOTS
        self.done = False

    def test(self):
        if self.done:
            return True
        world, comm = self.comm.world, self.comm
        with world.cond:
            if world.failure is not None and world.failure[0] != comm.global_rank:
                raise RankFailedError(f"[rank {comm.rank}] stopped waiting for rank {self.peer}: "
                                      f"rank {world.failure[0]} failed ({world.failure[1]!r})")
            box = world.boxes.get(self.key)
            if not box:
                source = comm.members[self.peer]
                if source in world.returned:
                    raise comm._peer_returned(self, source)
                return False
            item = box.popleft()
        if item.dtype != self.buf.dtype or item.nbytes != self.buf.nbytes:
            raise size_error(self.comm, self, item.nbytes, their_dtype=f"{item.dtype.name}, shape {item.shape}")
        self.buf.reshape(-1).view(np.uint8)[...] = item.reshape(-1).view(np.uint8)
        self.done = True
        return True


class ThreadCommunicator(Communicator):
    def __init__(self, world, group_id, members, rank, timeout=None, *, comm_timeout=DEFAULT_COMM_TIMEOUT,
                 uid="world", **guard_options):
        super().__init__(rank, len(members), timeout, comm_timeout=comm_timeout, uid=uid, members=members)
        wrap(self, **guard_options)
        self.world, self.group_id = world, group_id
        self.global_rank = members[rank]
        self.world_size = world.size

    def _isend(self, buf, dest, tag):
        data = np.ascontiguousarray(buf).copy() if isinstance(buf, np.ndarray) else buf.copy()
        with self.world.cond:
            self.world.boxes[(self.group_id, self.rank, dest, tag // DTYPE_SLOTS)].append(data)
            self.world.cond.notify_all()
        return _SendDone(dest, "send to")

    def _irecv(self, buf, source, tag):
        return _ThreadRecv(self, buf, source, tag)

    def _idle(self, seconds):
        with self.world.cond:
            self.world.cond.wait(seconds)

    def _snapshots(self, world_ranks, timeout):
        return {r: self.world.recorders[r].snapshot() for r in world_ranks}

    def _wait_for_reporter(self, reporter, seconds):
        deadline = time.monotonic() + seconds
        with self.world.cond:
            while self.world.failure is None and time.monotonic() < deadline:
                self.world.cond.wait(0.05)

    def _peer_returned(self, request, source):
        """The rank this receive waits for has returned from fn: its message can never come."""
        call = self._call()
        where = f"{call.name} #{call.seq}" if call else f"recv from rank {request.peer} (tag {request.tag})"
        snap = self.world.recorders[source].snapshot()
        last = [r for r in snap["records"] if r["comm"] == self.uid]
        return CollectiveMismatchError(
            f"[rank {self.rank}] flight recorder report: {where}{'' if self.uid == 'world' else ' on ' + self.uid} "
            f"waits for rank {source}, which has returned from fn: its message can never come (its last call "
            f"on {self.uid}: {call_name(last[-1]) if last else 'none'})")

    def _split(self, color, key):
        world_members, new_rank, uid = split_table(self, color, key)
        group_id = self.world.group_id((self.group_id, self._splits, color))
        return ThreadCommunicator(self.world, group_id, world_members, new_rank, self.timeout, uid=uid,
                                  **self._options())

    def abort(self, code=1):
        raise RankFailedError(f"[rank {self.rank}] abort({code})")


class ThreadWorld:
    """``ThreadWorld(size, timeout=None, *, comm_timeout=10.0, check_collectives=True, guard=True)``: the
    keywords of ``minitrain.comm.init`` (see Communicator); guard=False: the core alone (guard.py)."""

    def __init__(self, size, timeout=None, *, comm_timeout=DEFAULT_COMM_TIMEOUT, check_collectives=True, guard=True):
        if size < 1:
            raise ValueError(f"ThreadWorld needs at least one rank, got {size}")
        self.size = size
        self.timeout = HARD_TIMEOUT_FACTOR * comm_timeout if timeout is None else timeout
        self.cond = threading.Condition()
        self.boxes = defaultdict(deque)
        self.failure = None
        self.returned = set()
        self._groups = {}
        self.trackers = [memory.MemoryTracker() for _ in range(size)]
        self.tracers = [trace.Tracer(rank=r) for r in range(size)]
        self.recorders = [FlightRecorder(r) for r in range(size)]
        self.comms = [ThreadCommunicator(self, 0, list(range(size)), r, timeout, comm_timeout=comm_timeout,
                                         check_collectives=check_collectives, recorder=self.recorders[r], guard=guard)
                      for r in range(size)]

    def group_id(self, key):
        with self.cond:
            return self._groups.setdefault(key, len(self._groups) + 1)

    def run(self, fn, *args, **kwargs):
        """``fn(comm, *args, **kwargs)`` on every rank at once; returns the list of results.
        Once one rank has returned or failed, the others get ``timeout`` seconds to end."""
        results = [None] * self.size
        generators = [random.fork() for _ in range(self.size)]    # as processes: same seed, own stream
        self._reset()
        for recorder in self.recorders:
            recorder.set_status("running")

        def body(r):
            trace.set_tracer(self.tracers[r])
            try:
                with memory.use_tracker(self.trackers[r]), random.use_generator(generators[r]):
                    results[r] = fn(self.comms[r], *args, **kwargs)
                self.recorders[r].set_status("finished", "returned from fn")
                with self.cond:
                    self.returned.add(r)
                    self.cond.notify_all()
            except BaseException as e:
                self.recorders[r].set_status("failed", repr(e))
                with self.cond:
                    if self.failure is None:
                        self.failure = (r, e)
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        first_end = None
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.05)
            with self.cond:
                ended = self.failure is not None or bool(self.returned)
            if ended and first_end is None:
                first_end = time.monotonic()
            if first_end is not None and time.monotonic() - first_end > self.timeout:
                stuck = [r for r, t in enumerate(threads) if t.is_alive()]
                states = "\n".join(f"  rank {r}: " + self.recorders[r].format(last=2).replace("\n", "; ")
                                   for r in stuck)
                note = (f"ThreadWorld({self.size}).run: rank(s) {stuck} still running {self.timeout:g} s after "
                        f"the first rank ended (their last calls):\n{states}")
                with self.cond:                     # the stuck ranks stop at their next wait
                    failure = self.failure
                    self.failure = failure or (stuck[0], None)
                    self.cond.notify_all()
                if failure is None:
                    raise CollectiveTimeout(note)
                failure[1].add_note(f"raised on rank {failure[0]} of ThreadWorld({self.size}); {note}")
                raise failure[1]
        if self.failure is not None:
            rank, error = self.failure
            self._reset()
            error.add_note(f"raised on rank {rank} of ThreadWorld({self.size})")
            raise error
        self._reset()
        return results

    def _reset(self):
        self.failure = None
        self.boxes.clear()
        self.returned.clear()


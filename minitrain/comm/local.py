"""ThreadWorld: N ranks as threads in one process, for fast tests and notebooks.

ThreadWorld(4).run(fn) calls fn(comm) on four threads, each with its own
ThreadCommunicator (and its own memory tracker, tracer and random generator, so per-rank
accounting works and ranks draw the same numbers, as processes with one seed do),
and returns the four results. Messages go through one shared mailbox keyed by
(group, source, destination, tag); a send copies its buffer (so the sender may reuse it at
once, as after MPI_Send returns), a receive copies into the caller's buffer and checks the size.
If one rank raises, the others stop waiting within milliseconds and run re-raises the first
error with a note naming the rank.
"""
import threading
from collections import defaultdict, deque

import numpy as np

from .. import memory, random, trace
from .communicator import CommError, Communicator, RankFailedError, Request


class _SendDone(Request):
    def test(self):
        return True


class _ThreadRecv(Request):
    def __init__(self, comm, buf, source, tag):
        super().__init__(source, "recv from")
        self.comm, self.buf, self.tag = comm, buf, tag
        self.key = (comm.group_id, source, comm.rank, tag)
        self.done = False

    def test(self):
        if self.done:
            return True
        world = self.comm.world
        with world.cond:
            if world.failure is not None and world.failure[0] != self.comm.global_rank:
                raise RankFailedError(f"[rank {self.comm.rank}] stopped waiting for rank {self.peer}: "
                                      f"rank {world.failure[0]} failed ({world.failure[1]!r})")
            box = world.boxes.get(self.key)
            if not box:
                return False
            item = box.popleft()
        if item.nbytes != self.buf.nbytes:
            raise CommError(f"[rank {self.comm.rank}] recv from rank {self.peer} (tag {self.tag}): "
                            f"buffer holds {self.buf.nbytes} bytes, the message has {item.nbytes} bytes")
        self.buf.reshape(-1).view(np.uint8)[...] = item.reshape(-1).view(np.uint8)
        self.done = True
        return True


class ThreadCommunicator(Communicator):
    def __init__(self, world, group_id, members, rank, timeout=None):
        super().__init__(rank, len(members), timeout)
        self.world, self.group_id, self.members = world, group_id, members
        self.global_rank = members[rank]
        self._splits = 0

    def _isend(self, buf, dest, tag):
        data = np.ascontiguousarray(buf).copy() if isinstance(buf, np.ndarray) else buf.copy()
        with self.world.cond:
            self.world.boxes[(self.group_id, self.rank, dest, tag)].append(data)
            self.world.cond.notify_all()
        return _SendDone(dest, "send to")

    def _irecv(self, buf, source, tag):
        return _ThreadRecv(self, buf, source, tag)

    def _idle(self, seconds):
        with self.world.cond:
            self.world.cond.wait(seconds)

    def _split(self, color, key):
        from .collectives import ring_all_gather
        mine = np.array([color, key], np.int64)
        table = ring_all_gather(self, mine, total=2 * self.size).reshape(self.size, 2)
        members = sorted((int(k), r) for r, (c, k) in enumerate(table) if c == color)
        local_members = [self.members[r] for _, r in members]
        new_rank = [r for _, r in members].index(self.rank)
        self._splits += 1
        group_id = self.world.group_id((self.group_id, self._splits, color))
        return ThreadCommunicator(self.world, group_id, local_members, new_rank, self.timeout)

    def abort(self, code=1):
        raise RankFailedError(f"[rank {self.rank}] abort({code})")


class ThreadWorld:
    def __init__(self, size, timeout=None):
        if size < 1:
            raise ValueError(f"ThreadWorld needs at least one rank, got {size}")
        self.size, self.timeout = size, timeout
        self.cond = threading.Condition()
        self.boxes = defaultdict(deque)
        self.failure = None
        self._groups = {}
        self.trackers = [memory.MemoryTracker() for _ in range(size)]
        self.tracers = [trace.Tracer(rank=r) for r in range(size)]
        self.comms = [ThreadCommunicator(self, 0, list(range(size)), r, timeout) for r in range(size)]

    def group_id(self, key):
        with self.cond:
            return self._groups.setdefault(key, len(self._groups) + 1)

    def run(self, fn, *args, **kwargs):
        """``fn(comm, *args, **kwargs)`` on every rank at once; returns the list of results."""
        results = [None] * self.size
        errors = {}
        generators = [random.fork() for _ in range(self.size)]    # as processes: same seed, own stream

        def body(r):
            trace.set_tracer(self.tracers[r])
            try:
                with memory.use_tracker(self.trackers[r]), random.use_generator(generators[r]):
                    results[r] = fn(self.comms[r], *args, **kwargs)
            except BaseException as e:
                errors[r] = e
                with self.cond:
                    if self.failure is None:
                        self.failure = (r, e)
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.failure is not None:
            rank, error = self.failure
            self.failure = None
            self.boxes.clear()
            error.add_note(f"raised on rank {rank} of ThreadWorld({self.size})")
            raise error
        return results

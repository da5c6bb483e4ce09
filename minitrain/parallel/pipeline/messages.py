"""The pipeline's stage-to-stage messages: tags, headers, receives posted ahead, the waiting policy.

Tags name (micro-batch, receiving virtual stage, direction), so the order in which messages arrive
does not matter. A message is a small header (dtype, shape) then the array; the header is skipped
once the shapes of a batch shape are known (both ends see the same batch). Once they are, the
receive of a rank's next receiving action is posted (irecv) while the current one is still
awaited, and progress() (called around each compute) tests what is in flight: a large message
moves only while one of its ends is inside MPI, so without it the copy waited for the receive to
start. Two virtual stages on one rank (the bottom of zbv's V) hand the array over without a
message. Every send is non-blocking; its buffer is kept until the end of the step.

Bookkeeping once, not per message: the arrays go by comm.post_unrecorded (the routes are checked
when the runtime is built: contiguous buffers, tags in range), their bytes are counted at the
step's end, and a flight record is opened only for a message waited on (a stall names it as for
irecv): the communicator's per-call check, count and record cost ~50 us a message right after a
compute, where the neighbour stage waits for it (scripts/bench_message_cost.py).

Waiting: a pipeline's receive is idle time in the schedule, and what it costs is how late the
waiter runs again after the message is there. A rank that sleeps wakes late: on this machine's
virtual cores a 64 KiB message landed at a sleeping rank 31-124 us after it was sent, at a rank that
yielded 21-45 us (scripts/bench_message_cost.py, measured.md). So a receive yields (sched_yield) for
up to 1 ms, then sleeps 50 us at a time, but only where every rank on the machine has a core of its
own (waiting_poll): where ranks outnumber the cores, or are threads of one interpreter, the
neighbour stage needs that core (or the GIL) more than the poll, and the receive sleeps at once.
The thread's timer slack is 1 us: Linux otherwise stretches each sleep by 50 us (a 50 us sleep
lasted 118 us, with 1 us slack 67 us).

progress() tests one request: MPI's progress engine moves every message in flight on any test,
so one call is enough, and each further Python-level test costs ~15 us right after a compute
has evicted the caches.
"""
import ctypes
import sys

import numpy as np

from ...backend import array_module, bfloat16, local_rank_count, usable_cores

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + (
    [np.dtype(bfloat16)] if bfloat16 is not None else [])
HEADER = 10                            # dtype code, ndim, up to 8 dimensions
TAG_LIMIT = 32768                      # tags at and above belong to the collectives
YIELD_S, SLEEP_S = 1e-3, 5e-5           # wait_all: sched_yield this long (a core per rank), then sleep 50 us
TIMER_SLACK_NS = 1000


class StageMessages:
    """One rank's messages to and from its neighbour stages. begin() starts a step (batch_key:
    what the shapes are cached under); send / post / recv name a message by (peer, micro-batch,
    receiving virtual stage, backward?)."""

    def __init__(self, comm, p, v, poll=None):
        self.comm, self.p, self.v, self.rank = comm, p, v, comm.rank
        self.poll = waiting_poll(comm) if poll is None else poll
        self.shapes = {}                   # (batch key, mb, virtual, backward) -> (dtype code, shape)
        self.begin(None)
        fine_timer_slack()

    def tag(self, mb, virtual, backward, part):
        """Unique within a step: the micro-batch, the *receiving* virtual stage, the direction, header/array."""
        return 4 * (mb * self.p * self.v + virtual) + 2 * int(backward) + part

    def begin(self, batch_key):
        self.sends, self.handoff, self.posted, self.batch_key = [], {}, {}, batch_key
        self.moving = []                   # sends not yet seen complete (progress tests the oldest)
        self.counts = []                   # (direction, bytes) of the step's arrays, counted at its end

    def send(self, array, dest, mb, virtual, backward):
        if dest == self.rank:              # the next virtual stage is this rank's other chunk
            self.handoff[mb, virtual, backward] = array
            return
        array = array if array.flags.c_contiguous else array_module(array).ascontiguousarray(array)
        key = (self.batch_key, mb, virtual, backward)
        if key not in self.shapes:         # first time for this batch shape: say what comes
            header = np.zeros(HEADER, np.int64)
            header[0], header[1] = DTYPES.index(array.dtype), array.ndim
            header[2:2 + array.ndim] = array.shape
            self.shapes[key] = (int(header[0]), array.shape)
            self.sends.append((self.comm.isend(header, dest, self.tag(mb, virtual, backward, 0)), header))
        self.sends.append((self.comm.post_unrecorded(array, dest, self.tag(mb, virtual, backward, 1), "send"), array))
        self.moving.append(self.sends[-1][0])
        self.counts.append(("sent", array.nbytes))

    def move_sends(self):
        """One test of the oldest send still moving (progress(), and progress.py's thread while this rank
        computes); whether a send is still moving."""
        try:
            if self.moving and self.moving[0].test():
                del self.moving[0]
        except Exception:                  # left for the wait that owns the request to report
            return False
        return bool(self.moving)

    def progress(self):
        """One test: of the next receive posted ahead, else of the oldest send still moving (a
        failure is left for the wait that owns the request to report)."""
        if not self.posted:
            self.move_sends()
            return
        try:
            next(iter(self.posted.values()))[0].test()
        except Exception:
            pass

    def post(self, source, mb, virtual, backward, xp):
        """Post the receive now if its shape is known (else recv will, after the header)."""
        key = (self.batch_key, mb, virtual, backward)
        if source == self.rank or key not in self.shapes or key in self.posted:
            return
        code, shape = self.shapes[key]
        buf = xp.empty(shape, DTYPES[code])
        self.posted[key] = (self.comm.post_unrecorded(buf, source, self.tag(mb, virtual, backward, 1), "recv"), buf)

    def recv(self, source, mb, virtual, backward, xp):
        """The array: handed over, from the receive posted ahead, or received now."""
        if source == self.rank:
            return self.handoff.pop((mb, virtual, backward))
        key = (self.batch_key, mb, virtual, backward)
        if key not in self.shapes:
            header = np.zeros(HEADER, np.int64)
            self.wait([self.comm.irecv(header, source, self.tag(mb, virtual, backward, 0))], source)
            self.shapes[key] = (int(header[0]), tuple(int(d) for d in header[2:2 + int(header[1])]))
        self.post(source, mb, virtual, backward, xp)
        request, buf = self.posted.pop(key)
        self.wait([request], source)
        self.counts.append(("received", buf.nbytes))
        return buf

    def wait(self, requests, source):
        self._wait(requests, f"recv from rank {source}", "recv")

    def wait_for_sends(self):
        """The step's end: every send complete; the step's messages counted (once, here)."""
        self._wait([r for r, _ in self.sends], "pipeline sends", "send")
        stats = self.comm.stats
        for direction, nbytes in self.counts:
            stats.record("p2p", nbytes, direction)
        self.sends, self.counts = [], []

    def _wait(self, requests, what, kind):
        """A message already there costs one test; one that is not gets its flight record, then the wait."""
        pending = [r for r in requests if not self.comm.test(r, what)]
        if pending:
            self.comm.record_waits(pending, kind)
            self.comm.wait_all(pending, what, poll=self.poll)


def waiting_poll(comm, ranks_here=None, cores=None):
    """wait_all's (yield window, longest sleep) for a pipeline receive on ``comm``: yield first only
    if each process has a core (ranks on this machine: the MPI launcher's count; cores: this
    process's affinity). Ranks that are threads of one process (ThreadWorld) never yield."""
    if getattr(comm, "backend_name", None) is None:
        return 0.0, SLEEP_S
    ranks_here = local_rank_count() if ranks_here is None else ranks_here
    cores = usable_cores() if cores is None else cores
    return (YIELD_S if ranks_here <= cores else 0.0), SLEEP_S


def fine_timer_slack(nanoseconds=TIMER_SLACK_NS):
    """Let this thread's short sleeps end on time (Linux: prctl PR_SET_TIMERSLACK; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(29, nanoseconds, 0, 0, 0)
        except (OSError, AttributeError):
            pass

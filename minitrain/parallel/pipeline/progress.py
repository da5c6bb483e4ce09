"""Moving the messages while this rank computes, where MPI needs their sender inside MPI to move them.

A large message (a rendezvous: above MPI's eager limit, 4 KiB to 64 KiB) moves only while one of its
ends is inside MPI. Where MPI can copy it in one go from the receiver's side (Linux's cross-memory
attach, CMA: the mpich wheel by default; Open MPI's shared memory with CMA or XPMEM), the receiver
that waits for it moves it alone. Where it cannot (Open MPI with btl_vader_single_copy_mechanism=none,
which container images often set; MPICH with CMA off), every turn of the handshake and every copied
fragment needs the sender inside MPI too, and a sender that computes leaves its neighbour waiting
until the compute ends: the issue's job measured a message at 2-4 ms and GPipe's bubble at 0.18
(formula 0.059) on Open MPI 4.1.6 without CMA, against 67 us and 0.106 with it (measured.md).

moves_without_sender(comm) asks MPI, once, when the pipeline is built: each rank sends 256 KiB to the
next and stays out of MPI for 40 ms; did the message reach its waiting receiver in the first half?
Where it did not, ComputeProgress runs a thread that, while an action computes with sends in flight,
tests the oldest of them (a test turns MPI's progress engine for every message) 20 us after the
compute starts, then at doubling intervals up to 100 us, until none is left moving. The main thread
touches the sends again only once the thread's test under way is over (a lock), so the two never
test one request at once. Each test takes a time slice and the GIL from the compute (a first
version, testing for as long as anything was in flight, made 1F1B's step at m = 16 46% longer on
that Open MPI: measured.md), so where MPI moves messages alone there is no thread.
MINITRAIN_PROGRESS_THREAD=1 / 0 (or PipelineParallel's progress_thread=True / False) starts it or
not without asking.
"""
import os
import threading
import time
import weakref

import numpy as np

from ... import backend
from ...comm import all_reduce
from .messages import TAG_LIMIT, fine_timer_slack

ENV = "MINITRAIN_PROGRESS_THREAD"
PROBE_BYTES = 1 << 18                # above every shared-memory eager limit we know
ABSENT_S = 40e-3                     # the probe's sender stays out of MPI this long (the receiver looks for
                                     # half of it: a sender held off its core that long before its send is rare)
FIRST_POLL_S, LONGEST_POLL_S = 2e-5, 1e-4   # (400 us: fewer tests, messages 2-5 ms late on MPICH without CMA)
PROBE_TAG = TAG_LIMIT - 1            # the step's messages are posted only after the probe is over


def asked(progress_thread=None, environ=None):
    """True / False as asked (the argument, else MINITRAIN_PROGRESS_THREAD=1 / 0); None: ask MPI."""
    if progress_thread is not None:
        if not isinstance(progress_thread, bool):
            raise ValueError(f"progress_thread must be True, False or None (ask MPI), got {progress_thread!r}")
        return progress_thread
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    choices = {"": None, "auto": None, "1": True, "0": False}
    if value not in choices:
        raise ValueError(f"{ENV} must be auto, 1 or 0, got {value!r}")
    return choices[value]


def moves_without_sender(comm):
    """Whether a 256 KiB message reaches a waiting receiver while its sender stays out of MPI, on every
    pair of neighbour ranks (r, r + 1); the same answer on every rank. Even r send first, then odd r."""
    data, arrived = np.zeros(PROBE_BYTES // 8), True
    for turn in (0, 1):
        comm.barrier()
        if comm.rank % 2 == turn and comm.rank + 1 < comm.size:
            request = comm.isend(data, comm.rank + 1, PROBE_TAG)
            time.sleep(ABSENT_S)                         # outside MPI: nothing here moves the message
            comm.wait_all([request], "progress probe: send")
        elif comm.rank % 2 != turn and comm.rank > 0:
            request = comm.irecv(np.empty_like(data), comm.rank - 1, PROBE_TAG)
            deadline = time.monotonic() + ABSENT_S / 2
            while not (done := comm.test(request, "progress probe: recv")) and time.monotonic() < deadline:
                time.sleep(5e-5)
            arrived = arrived and done
            if not done:
                comm.wait_all([request], "progress probe: recv")
    return bool(all_reduce(comm, np.array([float(arrived)]), op="min")[0])


class ComputeProgress:
    """``progress.around(compute, messages)``: while the compute runs, a thread tests this rank's
    oldest send in flight (which turns MPI's progress engine for every message), after 20 us, then at
    doubling intervals up to 100 us, until no send is left moving; only if MPI needs it (``enabled``).
    The main thread touches the sends again only once the thread's test under way is over."""

    def __init__(self, comm, progress_thread=None):
        want = asked(progress_thread)
        self.probed, self.why = None, f"{ENV} or progress_thread said so"   # probed: moves_without_sender's answer
        if want is None:
            want, self.why = False, "no MPI: messages move by themselves"
            if getattr(comm, "backend_name", None) == "mpi" and comm.size > 1:
                self.probed = moves_without_sender(comm)
                want = not self.probed
                self.why = f"MPI moves a large message {'without' if self.probed else 'only with'} its sender"
        self.enabled, self.polls = want, 0
        self._computing, self._messages = False, None
        self._go, self._turn, self.thread = threading.Event(), threading.Lock(), None
        if want:                               # the thread holds this object weakly: it ends when the pipeline goes
            self.thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._go), daemon=True,
                                           name=f"pipeline-progress-rank{comm.rank}")
            weakref.finalize(self, self._go.set)
            self.thread.start()

    def around(self, compute, messages):
        """``compute`` run with the thread testing ``messages``' sends in flight (``compute`` itself where
        MPI moves them alone)."""
        if not self.enabled:
            return compute
        self._messages = messages

        def computing_with_sends_moved(action, received):
            if not messages.moving:
                return compute(action, received)
            with self:
                return compute(action, received)
        return computing_with_sends_moved

    def __enter__(self):
        self._computing = True
        self._go.set()

    def __exit__(self, *exc):
        self._computing = False
        with self._turn:                       # a test under way ends before this thread tests the sends
            pass

    def _move_sends_while_computing(self):
        delay = FIRST_POLL_S
        while self._computing:
            time.sleep(delay)
            with self._turn:
                if not self._computing:
                    return
                self.polls += 1
                if not self._messages.move_sends():
                    return
            delay = min(2 * delay, LONGEST_POLL_S)


def _serve(owner, go):
    """The thread: woken for each compute with sends in flight, until its ComputeProgress is collected."""
    backend.bind_thread()                      # the rank's GPU: a device transport's test may touch it
    fine_timer_slack()
    while True:
        go.wait()
        go.clear()
        progress = owner()
        if progress is None:
            return
        progress._move_sends_while_computing()
        del progress                           # asleep, the thread keeps no pipeline alive

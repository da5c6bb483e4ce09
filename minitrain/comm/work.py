"""How a collective runs: now, or queued (a Work handle), run by the progress thread or by its waiter.

Launcher.launch takes the collective's sequence number in program order, then runs its body here or
queues it. all_reduce(comm, x, async_op=True) queues the collective and returns a Work at once; the
communicator's progress thread runs it while the caller keeps computing (NumPy and the MPI waits
release the GIL in their heavy parts), and work.wait() returns its result. A wait on a collective
the progress thread has not started yet runs it on the waiting thread (and every one queued before
it, first): no handoff between threads, so an async collective waited on at once costs what the
synchronous one does (scripts/bench_async.py). Queued collectives run one at a time in submission
order, which is the same order on every rank, so their messages can never cross. Do not modify an
input array until its Work is done.
"""
import collections
import ctypes
import os
import sys
import threading
import time

from .. import backend, memory, trace
from .errors import CollectiveTimeout

START_DELAY_S = 1e-3       # the progress thread starts a queued collective about this long after its submission
DELAY_SCALES = (0.25, 8.0) # ... times a factor learnt in this range (Queue: halved or doubled per alarm)


class Launcher:
    """The part of a Communicator that runs collectives (``self.guard`` wraps each run, seam.py)."""

    #: a thread that waits on a queued collective not yet started runs it (False: only the progress thread)
    steal_queued = True

    def launch(self, name, body, args, async_op, header, nbytes):
        """Take the next sequence number now (program order, identical on every rank), then run
        ``body(self, tag, *args)`` here or on the progress thread."""
        seq_tag = self.next_tag(name)
        call = self.guard.opened(self, name, seq_tag[0], header, nbytes, async_op)
        if async_op:
            return self.submit(name, self.run_collective, name, seq_tag, header, nbytes, body, args, call)
        return self.run_collective(name, seq_tag, header, nbytes, body, args, call)

    def run_collective(self, name, seq_tag, header, nbytes, body, args, call):
        """Run ``body(self, tag, *args)`` as collective ``name``: its traffic counted under the name."""
        previous, self._local.call = self._call(), call
        self.stats.record_call(name)
        try:
            return self.guard.run(self, call, nbytes, lambda: body(self, seq_tag[1], *args))
        finally:
            self._local.call = previous

    def submit(self, name, fn, *args):
        """Queue ``fn(*args)`` on this communicator's progress thread; returns a Work named ``name``."""
        if self._progress is None:
            with self._progress_lock:
                if self._progress is None:
                    self._progress = Queue(self, steal=self.steal_queued)
        return self._progress.submit(name, fn, args)


class Work:
    """A queued collective: ``wait()`` returns its result once it has run (re-raises its error)."""

    def __init__(self, comm, name, queue):
        self.comm, self.name, self._queue = comm, name, queue
        self._done = False
        self._result = self._exception = None
        # a waiter that cannot run it itself sleeps on an event the runner sets
        self._event = None if queue.steal else threading.Event()

    def _finish(self, result=None, exception=None):
        self._result, self._exception, self._done = result, exception, True
        if self._event is not None:
            self._event.set()

    def is_completed(self):
        return self._done

    def wait(self, timeout=None):
        """Block until the collective has finished; returns its result (re-raises its error). If it
        has not started, this thread runs it (and every collective queued before it) itself.
        ``timeout`` bounds the wait for another thread's run; a run on this thread is bounded by the
        communicator's own timeouts (each wait inside it raises past ``comm.timeout``)."""
        if not self._done:
            timeout = self.comm.timeout + 5 if timeout is None else timeout
            if not (self._queue.run_until(self, timeout) if self._event is None else self._event.wait(timeout)):
                raise CollectiveTimeout(f"[rank {self.comm.rank}] async {self.name} did not finish "
                                        f"within {timeout:g} s")
        if self._exception is not None:
            raise self._exception
        return self._result

    def result(self):
        return self.wait()


class Queue:
    """The communicator's queued collectives, run one at a time in submission order by whoever holds
    the run lock: the progress thread (overlap: it runs them while the caller computes) or a thread
    that waits on one not yet started (no handoff: the waiter runs it, and every earlier one first).
    Invariant: an item is in the deque, or being run by the run lock's holder, or done; so a waiter
    that holds the lock and finds its Work not done finds it in the deque, behind the earlier ones.

    The progress thread is woken by an alarm the kernel rings a delay after a submission (Alarm;
    set when not already set, never taken back), not at once: waking it costs the caller ~25 us on a
    busy machine (a thread to schedule, the GIL to hand over), as much as a small collective, and a
    collective waited on at once is run by its waiter anyway. The delay is START_DELAY_S times a
    factor the queue learns, as an adaptive mutex learns how long to spin: an alarm that finds work
    (someone computes while collectives wait: DDP's buckets, FSDP's prefetch) halves it, down to
    START_DELAY_S / 4; one that finds the queue empty (their waiters ran them) doubles it, up to
    8 x START_DELAY_S. So a stream of collectives waited on at once wakes the thread rarely (and
    arms a timer rarely: a few us each), and overlapped ones start within a fraction of a millisecond.
    """

    def __init__(self, comm, steal=True):
        self.comm, self.steal = comm, steal
        self._items = collections.deque()     # appended without the lock: submit never waits for a run
        self._run = threading.Lock()
        self._alarm = Alarm() if steal else Alarm(timer=False)
        self._due, self._alarm_lock = None, threading.Lock()     # when the alarm rings (None: not set)
        self.delay_scale = 1.0
        self._thread = threading.Thread(target=self._loop, name=f"progress-rank{comm.rank}", daemon=True)
        self._thread.start()

    def submit(self, name, fn, args):
        work = Work(self.comm, name, self)
        self._items.append((fn, args, work, threading.get_ident(), memory.tracker(), trace.tracer()))
        self._wake(START_DELAY_S * self.delay_scale if self.steal else 0.0)
        return work

    def _wake(self, delay):
        """Have the progress thread look at the queue within ``delay`` s (sooner if already due)."""
        due = time.monotonic() + delay
        if self._due is not None and self._due <= due:
            return                        # already set to ring sooner (it drains what is queued now)
        with self._alarm_lock:
            if self._due is None or due < self._due:
                self._due = due
                self._alarm.arm(delay)

    def run_until(self, work, timeout):
        """Run queued collectives on this thread, oldest first, until ``work`` is done (False: the
        run lock was not free within ``timeout``)."""
        if not self._run.acquire(timeout=timeout):
            return False
        try:
            while not work._done:
                _execute(*self._items.popleft(), interrupt=True)
        finally:
            self._run.release()
            if self._items:               # left for the progress thread (it may have given up): now
                self._wake(0.0)
        return True

    def _loop(self):
        backend.bind_thread()             # the rank's GPU (a new thread starts on GPU 0)
        while True:
            self._alarm.wait()
            low, high = DELAY_SCALES
            self.delay_scale = (max(self.delay_scale / 2, low) if self._items else
                                min(self.delay_scale * 2, high))
            with self._alarm_lock:
                self._due = None          # a submission from here on sets it again
            # never holds an item outside the run lock (so order is kept); a waiter that holds the
            # lock runs what it needs and rings the alarm again for whatever it leaves
            while self._items and self._run.acquire(blocking=False):
                try:
                    if self._items:
                        _execute(*self._items.popleft())
                finally:
                    self._run.release()


class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _timespec), ("it_value", _timespec)]


class Alarm:
    """Wakes one thread (``wait``) at a time set by another (``arm``), without waking it before:
    Linux's timerfd, whose deadline the kernel keeps. Elsewhere (or ``timer=False``) a lock
    released at once: ``arm`` wakes the thread now, whatever the delay."""

    def __init__(self, timer=True):
        self._fd = None
        if timer and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._settime = libc.timerfd_settime
                fd = libc.timerfd_create(1, os.O_CLOEXEC)          # CLOCK_MONOTONIC
                self._fd = fd if fd >= 0 else None
            except (OSError, AttributeError):
                pass
        self._specs, self._off = {}, ctypes.byref(_itimerspec())     # made once: arming is one C call
        if self._fd is None:
            self._kick = threading.Lock()
            self._kick.acquire()

    def arm(self, delay):
        if self._fd is None:
            try:
                self._kick.release()
            except RuntimeError:          # already released: kicks do not count
                pass
            return
        spec = self._specs.get(delay)
        if spec is None:
            ns = max(int(delay * 1e9), 1)     # (a zero deadline would disarm it)
            spec = self._specs[delay] = ctypes.byref(_itimerspec(it_value=_timespec(ns // 10**9, ns % 10**9)))
        self._set(spec)

    def disarm(self):
        if self._fd is not None:
            self._set(self._off)

    def _set(self, spec):
        if self._settime(self._fd, 0, spec, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def wait(self):
        if self._fd is None:
            self._kick.acquire()
        else:
            os.read(self._fd, 8)          # blocks (without the GIL) until the deadline passes


def _execute(fn, args, work, thread, tracker, tracer, interrupt=False):
    """Run one queued item; on another thread than its submitter's, under the submitter's memory
    tracker and tracer. Its result or error goes to its Work (``interrupt``: on a waiting thread, an
    interrupt also stops the waiter)."""
    try:
        if thread == threading.get_ident():
            result = fn(*args)
        else:
            previous = trace.tracer()
            trace.set_tracer(tracer)
            try:
                with memory.use_tracker(tracker):
                    result = fn(*args)
            finally:
                trace.set_tracer(previous)
    except BaseException as e:      # delivered to whoever waits on the Work
        work._finish(exception=e)
        if interrupt and not isinstance(e, Exception):
            raise
    else:
        work._finish(result=result)

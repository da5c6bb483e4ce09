"""How a collective runs: now, or queued on the communicator's progress thread (a Work handle).

Launcher.launch takes the collective's sequence number in program order, then runs its body here or
queues it. all_reduce(comm, x, async_op=True) queues the collective on the communicator's progress
thread and returns a Work at once; the caller keeps computing (NumPy and the MPI waits
release the GIL in their heavy parts) and calls work.wait() when it needs the result.
Queued collectives run one at a time in submission order, which is the same order on every
rank, so their messages can never cross. Do not modify an input array until its Work is done.
"""
import queue
import threading

from .. import backend, memory, trace
from .errors import CollectiveTimeout


class Launcher:
    """The part of a Communicator that runs collectives (``self.guard`` wraps each run, seam.py)."""

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
        with self._progress_lock:
            if self._progress is None:
                self._progress = ProgressThread(self)
        return self._progress.submit(name, fn, args)


class Work:
    def __init__(self, comm, name):
        self.comm, self.name = comm, name
        self._done = threading.Event()
        self._result = None
        self._exception = None

    def _finish(self, result=None, exception=None):
        self._result, self._exception = result, exception
        self._done.set()

    def is_completed(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        """Block until the collective has finished; returns its result (re-raises its error)."""
        timeout = self.comm.timeout + 5 if timeout is None else timeout
        if not self._done.wait(timeout):
            raise CollectiveTimeout(f"[rank {self.comm.rank}] async {self.name} did not finish "
                                    f"within {timeout:g} s")
        if self._exception is not None:
            raise self._exception
        return self._result

    def result(self):
        return self.wait()


class ProgressThread:
    """Runs queued collectives in order, on behalf of the thread that submitted them (same memory
    tracker and tracer, so accounting and traces land on the right rank)."""

    def __init__(self, comm):
        self.comm = comm
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"progress-rank{comm.rank}", daemon=True)
        self._thread.start()

    def submit(self, name, fn, args):
        work = Work(self.comm, name)
        self._queue.put((fn, args, work, memory.tracker(), trace.tracer()))
        return work

    def _loop(self):
        backend.bind_thread()             # the rank's GPU (a new thread starts on GPU 0)
        while True:
            fn, args, work, tracker, tracer = self._queue.get()
            trace.set_tracer(tracer)
            try:
                with memory.use_tracker(tracker):
                    work._finish(result=fn(*args))
            except BaseException as e:      # delivered to whoever waits on the Work
                work._finish(exception=e)

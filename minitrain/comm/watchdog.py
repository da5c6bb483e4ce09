"""The out-of-band channel of an MPI job: a watchdog thread per rank on a duplicated COMM_WORLD.

A stalled rank cannot ask the others through the communicator it is stuck in, so every rank runs a
small thread that wakes every 50 ms (it sleeps, never spins: measured, a 4-rank job on 2 cores
does not see it) and answers four messages on its own communicator (MPI_Comm_idup of the world,
so they never meet the job's traffic):

* QUERY -> REPLY: this rank's flight recorder snapshot (what it is doing, its last calls);
* FINISHED: a rank has left the script (sent at exit, with its snapshot), so that a rank stalled in a
  collective learns that the peer it waits for has left, not just "no answer". Each rank waits at exit
  until every other rank has said so, answering queries meanwhile, for the hard timeout at most (then
  it says which ranks it leaves behind and goes: they know it has left);
* ABORT: a rank is about to end the job with its own report; the others stay quiet.

Control messages are small Python objects (pickled by mpi4py's lowercase calls); arrays never go here.
"""
import sys
import threading
import time

QUERY, REPLY, FINISHED, ABORT = 1, 2, 3, 4
POLL_S = 0.05


class Watchdog:
    def __init__(self, oob, recorder):
        from mpi4py import MPI
        self._mpi = MPI
        self.oob, self.recorder = oob, recorder
        self.rank, self.size = oob.Get_rank(), oob.Get_size()
        self.replies = {}
        self.cond = threading.Condition()
        self._orphans = []                   # our sends, tested until they complete
        self._orphans_lock = threading.Lock()
        self._query_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    # ---- the thread
    def _loop(self):
        status = self._mpi.Status()
        while not self._stop.is_set():
            while self.oob.Iprobe(self._mpi.ANY_SOURCE, self._mpi.ANY_TAG, status):
                source, tag = status.Get_source(), status.Get_tag()
                self._handle(source, tag, self.oob.recv(source=source, tag=tag))
            with self._orphans_lock:
                self._orphans = [r for r in self._orphans if not r.Test()]
            self._stop.wait(POLL_S)

    def _handle(self, source, tag, message):
        if tag == QUERY:
            self._send(self.recorder.snapshot(), source, REPLY)
        elif tag == REPLY:
            with self.cond:
                self.replies[source] = message
                self.cond.notify_all()
        elif tag == FINISHED:
            with self.cond:
                self.recorder.finished_peers[source] = message
                self.cond.notify_all()
        elif tag == ABORT:
            with self.cond:
                self.recorder.abort_notice = (source, message)
                self.cond.notify_all()

    def _send(self, obj, dest, tag):
        request = self.oob.isend(obj, dest, tag)
        with self._orphans_lock:
            self._orphans.append(request)

    # ---- used by the stalled thread, the exit handler and the abort path
    def query(self, ranks, timeout):
        """world rank -> snapshot (None: no answer within ``timeout``). Ranks that have left answer
        with the snapshot they sent at exit."""
        with self._query_lock:
            finished = dict(self.recorder.finished_peers)
            targets = [r for r in ranks if r != self.rank and r not in finished]
            with self.cond:
                for r in targets:
                    self.replies.pop(r, None)
            for r in targets:
                self._send(self.rank, r, QUERY)
            deadline = time.monotonic() + timeout
            with self.cond:
                while any(r not in self.replies for r in targets) and time.monotonic() < deadline:
                    self.cond.wait(POLL_S)
                result = {r: self.replies.get(r) for r in targets}
        result.update({r: finished[r] for r in ranks if r in finished})
        if self.rank in ranks:
            result[self.rank] = self.recorder.snapshot()
        return result

    def announce_abort(self, reason):
        for r in range(self.size):
            if r != self.rank:
                self._send(reason, r, ABORT)

    def wait_for(self, predicate, seconds):
        deadline = time.monotonic() + seconds
        with self.cond:
            while not predicate() and time.monotonic() < deadline:
                self.cond.wait(POLL_S)
        return predicate()

    def close(self, timeout):
        """At exit: tell every rank this one has left, wait until all have (answering queries) for
        ``timeout`` seconds at most, then stop the thread before MPI_Finalize."""
        if self._stop.is_set():
            return
        snapshot = self.recorder.snapshot()
        for r in range(self.size):
            if r != self.rank:
                self._send(snapshot, r, FINISHED)
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.recorder.finished_peers) < self.size - 1 and self.recorder.abort_notice is None:
                if time.monotonic() > deadline:
                    behind = [r for r in range(self.size) if r != self.rank and r not in self.recorder.finished_peers]
                    sys.stderr.write(f"[rank {self.rank}] left the script {timeout:g} s ago; rank(s) {behind} have "
                                     "not: not waiting for them any longer (they know this rank has left)\n")
                    sys.stderr.flush()
                    break
                self.cond.wait(POLL_S)
        deadline = time.monotonic() + 10.0          # our FINISHED messages: received by now, or never
        while time.monotonic() < deadline:
            with self._orphans_lock:
                self._orphans = [r for r in self._orphans if not r.Test()]
                if not self._orphans:
                    break
            time.sleep(0.01)
        self._stop.set()
        self._thread.join()

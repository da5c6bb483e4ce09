"""Asynchronous collectives (minitrain/comm/work.py): run by the thread that waits on them when the
progress thread has not started them (the steal path), or by the progress thread (the overlap path);
either way in submission order on every rank, exact, and an error reaches whoever waits. Under MPI
(tests/programs/async_check.py): both paths equal to MPI_Allreduce at p = 2 and 4."""
import sys
import threading
import time

import numpy as np
import pytest

from minitrain.comm import CollectiveMismatchError, ThreadWorld, all_reduce, ring_all_reduce
from minitrain.comm import work
from minitrain.testing import run_mpi

PROGRAM = __import__("pathlib").Path(__file__).parent / "programs" / "async_check.py"


# the steal tests keep the progress thread asleep with a far alarm (Linux's timerfd; elsewhere
# the alarm wakes it at once, and which thread runs a collective is a race)
needs_timer = pytest.mark.skipif(work.Alarm()._fd is None, reason="no timerfd: the progress thread wakes at once")


@pytest.fixture
def ran_on(monkeypatch):
    """Which thread ran each queued collective: {rank: ["main" | "progress", ...]}, in run order."""
    seen, lock, execute = {}, threading.Lock(), work._execute

    def spy(fn, args, w, *rest, **kwargs):
        kind = "progress" if threading.current_thread().name.startswith("progress") else "main"
        with lock:
            seen.setdefault(w.comm.rank, []).append(kind)
        return execute(fn, args, w, *rest, **kwargs)
    monkeypatch.setattr(work, "_execute", spy)
    return seen


def started_in_order(comm):
    """The sequence numbers of this rank's collectives on ``comm``, in the order they started."""
    records = [r for r in comm.recorder.records if r.comm == comm.uid and r.seq >= 0]
    return [r.seq for r in sorted(records, key=lambda r: r.start)]


@needs_timer
def test_a_collective_waited_on_before_it_starts_runs_on_the_waiter_in_submission_order(monkeypatch, ran_on):
    monkeypatch.setattr(work, "START_DELAY_S", 3600.0)       # the progress thread never wakes: every wait runs them

    def fn(comm):
        works = [all_reduce(comm, np.full(1000 + 7 * i, float(comm.rank + i)), async_op=True) for i in range(4)]
        # rank 0 waits on the last first: its wait must run the three before it, in order, first;
        # the others wait in order. Any other order on rank 0 would wait for a call rank 1 has not made.
        order = range(3, -1, -1) if comm.rank == 0 else range(4)
        results = {i: works[i].wait() for i in order}
        return [results[i] for i in range(4)], started_in_order(comm), all(w.is_completed() for w in works)
    for values, started, done in ThreadWorld(3, comm_timeout=2.0).run(fn):
        for i, v in enumerate(values):
            assert v.shape == (1000 + 7 * i,) and np.all(v == 3 * i + 0 + 1 + 2)
        assert started == sorted(started) and done
    assert ran_on == {r: ["main"] * 4 for r in range(3)}


def test_a_collective_the_progress_thread_started_is_waited_for_and_exact(monkeypatch, ran_on):
    monkeypatch.setattr(work, "START_DELAY_S", 0.0)

    def fn(comm):
        works = [ring_all_reduce(comm, np.full(5000, float(comm.rank + i)), async_op=True) for i in range(3)]
        deadline = time.monotonic() + 30
        while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
            time.sleep(1e-3)                                   # computing, as DDP's backward does
        return [w.wait()[0] for w in works[::-1]], started_in_order(comm)
    for values, started in ThreadWorld(2).run(fn):
        assert values == [5.0, 3.0, 1.0] and started == sorted(started)
    assert ran_on == {r: ["progress"] * 3 for r in range(2)}


def test_an_error_in_a_collective_run_by_a_waiter_reaches_the_wait_on_that_collective(monkeypatch):
    monkeypatch.setattr(work, "START_DELAY_S", 3600.0)

    def fn(comm):
        bad = all_reduce(comm, np.ones(3 + comm.rank), async_op=True)       # shapes differ: the check raises
        good = all_reduce(comm, np.ones(4), async_op=True)
        assert good.wait()[0] == 2.0                                        # ran the bad one first, kept its error
        assert bad.is_completed()
        with pytest.raises(CollectiveMismatchError, match="shape"):
            bad.wait()
        with pytest.raises(CollectiveMismatchError):                         # every wait re-raises it
            bad.wait()
    # the rank that does not report gives the reporter up to comm_timeout + 2 s to end the job
    # (reports.raise_once) before it raises too: here the reporter goes on, so keep that short
    ThreadWorld(2, comm_timeout=0.5, timeout=5.0).run(fn)


def test_a_waiter_whose_peer_never_calls_the_collective_names_that_rank(monkeypatch):
    monkeypatch.setattr(work, "START_DELAY_S", 3600.0)

    def fn(comm):
        if comm.rank == 0:
            all_reduce(comm, np.ones(10), async_op=True).wait()
    with pytest.raises(Exception, match=r"rank 1"):
        ThreadWorld(2, comm_timeout=1.0).run(fn)


@needs_timer
def test_the_progress_thread_starts_what_a_waiter_left_behind(monkeypatch, ran_on):
    """A waiter runs only up to its own collective; the ones queued after it are started by the
    progress thread (woken by the waiter), not left until someone waits on them."""
    monkeypatch.setattr(work, "START_DELAY_S", 3600.0)

    def fn(comm):
        works = [all_reduce(comm, np.full(100, 1.0 + i), async_op=True) for i in range(3)]
        works[0].wait()
        deadline = time.monotonic() + 30
        while not works[2].is_completed() and time.monotonic() < deadline:
            time.sleep(1e-3)
        return [w.wait()[0] for w in works]
    assert ThreadWorld(2).run(fn) == [[2.0, 4.0, 6.0]] * 2
    assert all(kinds[0] == "main" and kinds[1:] == ["progress", "progress"] for kinds in ran_on.values()), ran_on


def test_a_waiter_never_runs_a_collective_beside_the_one_the_progress_thread_runs(monkeypatch):
    """Rank 0's progress thread starts A and waits in it for rank 1 (late); rank 0 then waits on B,
    queued after A: it must wait for A to end before it runs B (one collective at a time, in order)."""
    monkeypatch.setattr(work, "START_DELAY_S", 0.0)

    def fn(comm):
        if comm.rank == 1:
            time.sleep(0.3)
        a = all_reduce(comm, np.ones(1000), async_op=True)
        b = all_reduce(comm, np.ones(10), async_op=True)
        if comm.rank == 0:
            time.sleep(0.1)                        # the progress thread has started A, and waits in it
        b.wait()
        a.wait()
        records = sorted((r for r in comm.recorder.records if r.comm == comm.uid and r.seq >= 0), key=lambda r: r.seq)
        return [(r.start, r.end) for r in records]
    for spans in ThreadWorld(2).run(fn):
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans


@needs_timer
def test_the_alarm_learns_to_wait_longer_when_waiters_run_everything_and_less_when_it_finds_work(monkeypatch):
    monkeypatch.setattr(work, "START_DELAY_S", 1e-3)

    def rang(queue):                           # the alarm rang and the progress thread has looked
        deadline = time.monotonic() + 30
        while queue._due is not None and time.monotonic() < deadline:
            time.sleep(1e-3)
        time.sleep(1e-3)

    def fn(comm):
        all_reduce(comm, np.ones(10), async_op=True).wait()
        queue, scales = comm._progress, []
        for _ in range(6):                     # waited on at once: each alarm finds nothing to do
            all_reduce(comm, np.ones(10), async_op=True).wait()
            rang(queue)
            scales.append(queue.delay_scale)
        armed, arm = [], queue._alarm.arm
        queue._alarm.arm = lambda delay: (armed.append(delay), arm(delay))
        for _ in range(6):                     # left to the progress thread: each alarm finds work
            w = all_reduce(comm, np.ones(10), async_op=True)
            rang(queue)
            w.wait()
            scales.append(queue.delay_scale)
        return scales, armed
    low, high = work.DELAY_SCALES
    for scales, armed in ThreadWorld(2).run(fn):
        assert scales[:6] == sorted(scales[:6]) and scales[5] == high, scales
        assert scales[6:] == sorted(scales[6:], reverse=True) and scales[-1] == low, scales
        assert armed == [1e-3 * s for s in [high] + scales[6:-1]], armed      # each submission used the scale


def test_order_and_results_hold_with_the_alarm_that_wakes_at_once(monkeypatch):
    """Without timerfd (or with steal_queued=False's alarm) the progress thread is woken at every
    submission and races the waiter for each collective: still one at a time, in order."""
    alarm = work.Alarm
    monkeypatch.setattr(work, "Alarm", lambda timer=True: alarm(timer=False))

    def fn(comm):
        works = [all_reduce(comm, np.full(2000, float(comm.rank + i)), async_op=True) for i in range(6)]
        order = range(5, -1, -1) if comm.rank == 0 else range(6)
        results = {i: works[i].wait()[0] for i in order}
        return [results[i] for i in range(6)], started_in_order(comm)
    for values, started in ThreadWorld(3).run(fn):
        assert values == [3.0 * i + 3 for i in range(6)] and started == sorted(started)


@pytest.mark.parametrize("p", [2, 4])
def test_both_paths_equal_mpi_allreduce_under_mpi(p):
    result = run_mpi([sys.executable, str(PROGRAM)], n=p, timeout=120)
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("async ok") == p, result.stdout

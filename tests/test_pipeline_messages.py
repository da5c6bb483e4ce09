"""The pipeline's messages: the simulator charges a message between stages (and nothing when a
rank hands over to itself, or when the cost is 0), the measured cost of a message is read off the
stamps, each receive is posted one ahead and lands in its own action (losses equal one process),
what is in flight is tested around each compute, and a pipeline receive yields before it sleeps only
where every rank has a core of its own."""
import ctypes
import sys
import threading
import time
import types

import numpy as np
import pytest

import minitrain as mt
from minitrain import optim
from minitrain.comm import ThreadWorld
from minitrain.comm import communicator as communicator_module
from minitrain.nn import functional as F
from minitrain.parallel.pipeline import PipelineParallel, get_schedule, simulate
from minitrain.parallel.pipeline.measure import message_costs
from minitrain.parallel.pipeline import messages as messages_module
from minitrain.parallel.pipeline.messages import SLEEP_S, YIELD_S, StageMessages, waiting_poll
from minitrain.parallel.pipeline.schedules import NAMES
from test_pipeline import assert_equal_to_reference, batches, make_model, reference_run


# ---------------------------------------------------------------- the simulator's message cost
@pytest.mark.parametrize("name", NAMES)
def test_a_free_message_simulates_as_before(name):
    for p, m in ((2, 4), (3, 6), (4, 8)):
        schedule = get_schedule(name, p, m, chunks=2 if name == "interleaved_1f1b" else None)
        for costs in ((1.0, 2.0, 0.0), (1.0, 1.2, 0.7), ([0.5, 1.5] * (len(schedule) * 2), 1.0, 1.0)):
            assert simulate(schedule, *costs, message_cost=0.0) == simulate(schedule, *costs)


def test_each_message_between_stages_is_charged_once_on_the_critical_path():
    c = 0.25
    # GPipe, p = 2, m = 1: F0 [0, 1], F1 [1 + c, 2 + c], B1 [2 + c, 4 + c], B0 [4 + 2c, 6 + 2c]
    sim = simulate(get_schedule("gpipe", 2, 1), 1.0, 2.0, 0.0, message_cost=c)
    assert [(s, e) for _, s, e in sim["timeline"][1]] == [(1 + c, 2 + c), (2 + c, 4 + c)]
    assert sim["total_time"] == 6 + 2 * c
    # 1F1B, p = 2, m = 4: the warm-up's hop and the drain's, each way
    assert simulate(get_schedule("1f1b", 2, 4), 1.0, 2.0, 0.0, message_cost=c)["total_time"] == 15 + 4 * c
    # ZB-V, p = 2, m = 1: four hops between ranks; the V's bottom (rank 1 to itself) is free
    assert simulate(get_schedule("zbv", 2, 1), 1.0, 1.0, 1.0, message_cost=c)["total_time"] == 10 + 4 * c


def test_the_costs_of_a_message_are_read_off_the_sends_and_receives():
    """GPipe, p = 2, m = 1 (the hand-made step of test_pipeline_zero_bubble): rank 0 posts F0's
    send over [3, 3.5], rank 1 (waiting since -0.5) has it at 4: latency 0.5; rank 1 posts B0's
    over [7.5, 7.7], rank 0 (waiting since 4) has it at 8: 0.3. Sends take 0.5 and 0.2. A receive
    that found its message there counts for the receive overhead, not the latency."""
    nan = np.nan
    rows = np.array([[[0.0, 10.0, 0.3, 0.0, 1, 3, nan, nan, 3, 3.5, 8, 9.5, 4, 8, nan, nan]],
                     [[-1.0, 10.2, 2.0, 0.0, 4, 5.5, -0.5, 4, nan, nan, 5.5, 7.5, nan, nan, 7.5, 7.7]]])
    schedule = get_schedule("gpipe", 2, 1)
    assert message_costs(rows, schedule, [0]) == pytest.approx((0.4, 0.35, 0.0))
    late = rows.copy()
    late[0, 0, 12:14] = [7.9, 8.1]               # rank 0 asks only after B0 was sent: it takes 0.2
    assert message_costs(late, schedule, [0]) == pytest.approx((0.5, 0.35, 0.2))
    late[1, 0, 6:8] = [3.6, 3.7]
    assert message_costs(late, schedule, [0]) == pytest.approx((0.0, 0.35, 0.15))


def test_posting_and_taking_a_message_is_stage_time_but_not_work():
    # GPipe, p = 2, m = 1, F = 1, B = 2; latency c, send overhead o_s, receive overhead o_r:
    # rank 0: F0 [0, 1], posts until 1 + o_s; rank 1 waits, has it at 1 + o_s + c: F0, then B0 (its
    # own output: no message), posts its gradient until 4 + o_s + c + o_s; rank 0 has it c later.
    c, o_s, o_r = 0.25, 0.5, 0.125
    sim = simulate(get_schedule("gpipe", 2, 1), 1.0, 2.0, 0.0, message_cost=c, send_overhead=o_s,
                   receive_overhead=o_r)
    assert [(s, e) for _, s, e in sim["timeline"][1]] == [(1 + o_s + c, 2 + o_s + c), (2 + o_s + c, 4 + o_s + c)]
    assert sim["total_time"] == 6 + 2 * (o_s + c)
    assert sim["send_per_stage"] == [o_s, o_s] and sim["transfer_per_stage"] == [c, c]
    assert sim["bubble_fraction"] == pytest.approx(1 - 6 / (2 * sim["total_time"]))
    # 1F1B, p = 2, m = 4: rank 1's later forwards find their input there and pay o_r each
    busy = simulate(get_schedule("1f1b", 2, 4), 1.0, 2.0, 0.0, message_cost=0.0, receive_overhead=o_r)
    assert busy["transfer_per_stage"][1] == pytest.approx(3 * o_r) and busy["send_per_stage"] == [0.0, 0.0]


# ---------------------------------------------------------------- receives posted ahead
@pytest.mark.parametrize("schedule, m, v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 4, 2),
                                            ("zb_h1", 4, 1), ("zbv", 4, None)])
def test_each_receive_is_posted_one_ahead_and_lands_in_its_own_action(schedule, m, v):
    reference, ref_losses = reference_run()
    init = make_model().state_dict()

    def fn(comm):
        mt.set_default_dtype(np.float64)
        model = make_model()
        model.load_state_dict(init)
        pipe = PipelineParallel(model, comm, schedule, m, chunks=v)
        messages, step, seen = pipe.messages, [0], []
        recv = messages.recv

        def spy(source, mb, virtual, backward, xp):
            if source != comm.rank:             # (step, posted before the action asked, receives outstanding)
                seen.append((step[0], (messages.batch_key, mb, virtual, backward) in messages.posted,
                             len(messages.posted)))
            return recv(source, mb, virtual, backward, xp)
        messages.recv = spy
        opt = optim.Adam(pipe.parameters(), lr=1e-2)
        losses = []
        for step[0], (x, y) in enumerate(batches(3)):
            opt.zero_grad()
            losses.append(pipe.train_step(x, y, F.cross_entropy))
            opt.step()
            assert not messages.posted           # every receive posted was taken by its action
        return (pipe.full_state_dict(), losses), seen
    results = ThreadWorld(2).run(fn)
    assert_equal_to_reference([state for state, _ in results], reference, ref_losses)
    for _, seen in results:
        assert seen and all(not ahead for s, ahead, _ in seen if s == 0)   # shapes unknown: header first
        later = [(ahead, outstanding) for s, ahead, outstanding in seen if s > 0]
        assert len(later) == 2 * len(seen) // 3
        assert all(ahead for ahead, _ in later)
        assert max(n for _, n in later) == 2 and later[-1][1] == 1        # this one and the next one


class _Request:
    def __init__(self, done):
        self.done, self.tests = done, 0

    def test(self):
        self.tests += 1
        return self.done


def test_progress_tests_one_request_the_next_receive_first_then_the_oldest_send():
    messages = StageMessages(ThreadWorld(1).comms[0], 2, 1)
    early, late, sent, moving = _Request(False), _Request(True), _Request(True), _Request(False)
    messages.posted = {"a": (early, None), "b": (late, None)}
    messages.moving = [sent, moving]
    messages.progress()
    assert [r.tests for r in (early, late, sent, moving)] == [1, 0, 0, 0]
    assert messages.moving == [sent, moving] and len(messages.posted) == 2     # a receive stays until its action
    messages.posted = {}
    messages.progress()                        # no receive ahead: the oldest send, dropped once done
    messages.progress()
    assert [r.tests for r in (sent, moving)] == [1, 1] and messages.moving == [moving]


def test_what_is_in_flight_is_moved_on_before_and_after_each_compute():
    def fn(comm):
        mt.set_default_dtype(np.float64)
        pipe = PipelineParallel(make_model(), comm, "1f1b", 4)
        calls, progress = [], pipe.messages.progress
        pipe.messages.progress = lambda: (calls.append(1), progress())
        for x, y in batches(2):
            pipe.train_step(x, y, F.cross_entropy)
        return len(calls), len(pipe.actions)
    for calls, actions in ThreadWorld(2).run(fn):
        assert calls == 2 * 2 * actions


# ---------------------------------------------------------------- how a receive waits
def test_a_pipeline_receive_yields_first_only_where_each_rank_has_a_core(monkeypatch):
    mpi = types.SimpleNamespace(rank=0, backend_name="mpi")
    assert waiting_poll(mpi, ranks_here=2, cores=2) == (YIELD_S, SLEEP_S) and YIELD_S > 0
    assert waiting_poll(mpi, ranks_here=1, cores=16) == (YIELD_S, SLEEP_S)
    assert waiting_poll(mpi, ranks_here=3, cores=2) == (0.0, SLEEP_S)        # ranks outnumber the cores
    assert waiting_poll(ThreadWorld(1).comms[0], ranks_here=1, cores=16) == (0.0, SLEEP_S)   # threads: one GIL
    # by default: the launcher's count of ranks on this machine, against this process's cores
    monkeypatch.setattr(messages_module, "usable_cores", lambda: 4)
    for ranks, window in (("4", YIELD_S), ("5", 0.0)):
        monkeypatch.setenv("MPI_LOCALNRANKS", ranks)
        assert StageMessages(mpi, 2, 1).poll == (window, SLEEP_S)


def test_a_pipeline_receive_among_threads_sleeps_and_never_yields(monkeypatch):
    monkeypatch.setattr(communicator_module, "YIELD_WINDOW_S", 10e-3)     # the default (the suite's conftest sets 0)
    yields = []
    yield_now = communicator_module.os.sched_yield
    monkeypatch.setattr(communicator_module.os, "sched_yield",
                        lambda: (yields.append(threading.get_ident()), yield_now()))

    def fn(comm):
        if comm.rank == 0:
            for tag in (3, 4):
                comm.recv(np.zeros(1), 1, 10 + tag)      # rank 1 waits already
                time.sleep(0.2)
                comm.send(np.ones(4), 1, tag)
            return None
        sleeps, idle = [], comm._idle
        comm._idle = lambda seconds: (sleeps.append(seconds), idle(seconds))
        counted = []
        for tag, poll in ((3, StageMessages(comm, 2, 1).poll), (4, None)):
            request = comm.irecv(np.zeros(4), 0, tag)
            comm.send(np.zeros(1), 0, 10 + tag)
            before, sleeps[:] = len(yields), []
            comm.wait_all([request], poll=poll)
            mine = [t for t in yields[before:] if t == threading.get_ident()]
            counted.append((len(mine), max(sleeps)))
        return counted
    pipeline, default = ThreadWorld(2).run(fn)[1]
    assert pipeline[0] == 0 and pipeline[1] == SLEEP_S
    assert default[0] > 0 and default[1] == communicator_module.MAX_SLEEP_S


def moving_clock(monkeypatch, tick):
    """wait_all's clock, moved on by ``tick`` seconds at each reading (no thread timing); [now]."""
    clock = [0.0]

    def monotonic():
        clock[0] += tick
        return clock[0]
    monkeypatch.setattr(communicator_module.time, "monotonic", monotonic)
    return clock


def test_a_pipeline_receive_given_a_window_yields_then_sleeps_fifty_microseconds_at_a_time(monkeypatch):
    # the poll a rank with its own core gets: sched_yield while the window lasts, then 50 us sleeps
    # (a clock the test moves, 0.1 ms a reading)
    clock, yields = moving_clock(monkeypatch, 1e-4), []
    monkeypatch.setattr(communicator_module.os, "sched_yield", lambda: yields.append(clock[0]))

    def fn(comm):
        sleeps = []
        comm._idle = lambda seconds: sleeps.append((clock[0], seconds))
        comm.test = lambda request, what="test": clock[0] >= 0.005
        comm.wait_all([types.SimpleNamespace(buf=np.zeros(1))], poll=(YIELD_S, SLEEP_S))
        return sleeps
    sleeps = ThreadWorld(1, guard=False).run(fn)[0]
    assert yields and max(yields) <= YIELD_S + 2e-4 and sleeps and min(t for t, _ in sleeps) >= YIELD_S
    assert {seconds for _, seconds in sleeps} == {SLEEP_S}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's timer slack is Linux's")
def test_a_pipeline_thread_sleeps_with_a_fine_timer_slack():
    def fn(comm):
        prctl = ctypes.CDLL(None).prctl
        prctl(29, 50_000, 0, 0, 0)                        # PR_SET_TIMERSLACK: Linux's default, 50 us
        before = prctl(30, 0, 0, 0, 0)                    # PR_GET_TIMERSLACK
        StageMessages(comm, 2, 1)
        return before, prctl(30, 0, 0, 0, 0)
    for before, after in ThreadWorld(2).run(fn):
        assert before == 50_000 and after == 1_000


def test_a_measured_step_is_simulated_action_by_action():
    # GPipe, p = 2, m = 1 with each action's own duration: rank 0's F0 takes 2 and its B0 1.5, rank 1's
    # F0 1.5 and B0 2 (their stages' means would be F = B = 1.75 everywhere)
    took = {(0, 0): 2.0, (0, 1): 1.5, (1, 0): 1.5, (1, 1): 2.0}
    schedule = get_schedule("gpipe", 2, 1)
    sim = simulate(schedule, action_cost=lambda stage, i: took[stage, i])
    assert [(s, e) for _, s, e in sim["timeline"][0]] == [(0.0, 2.0), (5.5, 7.0)]
    assert [(s, e) for _, s, e in sim["timeline"][1]] == [(2.0, 3.5), (3.5, 5.5)]
    assert sim["bubble_fraction"] == 0.5
    with_messages = simulate(schedule, message_cost=0.25, send_overhead=0.5, action_cost=lambda stage, i: took[stage, i])
    assert with_messages["total_time"] == 7.0 + 2 * (0.25 + 0.5)


def test_a_wait_on_a_big_message_keeps_yielding_past_the_window_instead_of_sleeping(monkeypatch):
    # 32 MiB pending: at least 32 MiB / 1 GB/s of polling (an MPI moving it in fragments moves it only
    # while polled); the same 30 ms wait on 8 bytes sleeps after the 10 ms window. A clock the test moves
    # (1 ms a reading) and a request done at 30 ms: no thread timing.
    clock = moving_clock(monkeypatch, 1e-3)

    def fn(comm):
        sleeps = []
        comm._idle = sleeps.append
        comm.test = lambda request, what="test": clock[0] >= request.done_at
        slept = []
        for n in (None, 1, 4 << 20):           # None: a transport's own request, which carries no buffer
            request = types.SimpleNamespace(buf=None if n is None else np.zeros(n), done_at=clock[0] + 0.030)
            sleeps[:] = []
            comm.wait_all([request])
            slept.append(len(sleeps))
        return slept
    bufferless, small, big = ThreadWorld(1, guard=False).run(fn)[0]
    assert bufferless > 0 and small > 0 and big == 0


def test_the_yield_window_is_minitrain_comm_yield_s_seconds_else_10_ms():
    """MINITRAIN_COMM_YIELD_S: how long a waiting rank polls with sched_yield before it sleeps (the suite sets 0:
    its two workers share the cores); unset or empty, 10 ms; a negative value is 0; not a finite number: refused."""
    import os
    import subprocess
    import sys
    code = "import minitrain.comm.communicator as c; print(c.YIELD_WINDOW_S)"
    env = {k: v for k, v in os.environ.items() if k != "MINITRAIN_COMM_YIELD_S"}
    for value, window in ((None, "0.01"), ("", "0.01"), ("0", "0.0"), ("0.002", "0.002"), ("-1", "0.0")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env=env if value is None else {**env, "MINITRAIN_COMM_YIELD_S": value})
        assert run.stdout.strip() == window, (value, run.stdout)
    # not a number, or no end to the yielding (a waiting rank would spin for ever): refused at import, by name
    for value in ("abc", "inf", "nan", "1e400"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**env, "MINITRAIN_COMM_YIELD_S": value})
        assert run.returncode != 0 and not run.stdout, (value, run.stdout)
        last = run.stderr.strip().splitlines()[-1]
        assert last == (f"ValueError: MINITRAIN_COMM_YIELD_S must be a finite number of seconds (the sched_yield "
                        f"window of a waiting rank), got {value!r}"), (value, last)

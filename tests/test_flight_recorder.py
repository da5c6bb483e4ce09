"""No silent wrong answers, no silent hangs, in-process (ThreadWorld): the receive contract (size and
dtype), ``out=`` checked before a byte moves, check_collectives, and the flight recorder's verdicts
(a rank at another call or gone ends the run at once, a slow rank is named and waited for up to
the hard timeout, a deadlock is named). The same faults under mpiexec: tests/test_faults.py."""
import re
import time

import numpy as np
import pytest

from minitrain.comm import (ALL_REDUCE_ALGORITHMS, CollectiveMismatchError, CollectiveTimeout, CommError, DeviceMesh,
                            FlightRecorder, ThreadWorld, all_reduce, broadcast, ring_all_gather, ring_all_reduce,
                            ring_reduce_scatter)


STALLED = "has waited"          # the stall report's words: a call waited past comm_timeout


def run_failing(world, fn, error=CommError):
    """Run ``fn`` on ``world``, expect ``error``; returns its message."""
    with pytest.raises(error) as err:
        world.run(fn)
    return str(err.value)


# ---------------------------------------------------------------- the receive contract
def test_a_receive_of_another_size_names_both_ranks_the_tag_and_both_sizes():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.ones(3), 1, tag=5)
        else:
            comm.recv(np.empty(2), 0, tag=5)
    text = run_failing(ThreadWorld(2), fn)
    assert "[rank 1] recv from rank 0 (tag 5)" in text and "24 bytes" in text and "expected 16 bytes" in text, text


def test_a_receive_of_another_dtype_with_the_same_bytes_is_refused():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.ones(4, np.float32), 1, tag=7)
        else:
            comm.recv(np.empty(2, np.float64), 0, tag=7)
    text = run_failing(ThreadWorld(2), fn)
    assert "tag 7" in text and "float32" in text and "float64" in text and "16 bytes" in text, text


def test_a_peer_outside_the_world_and_a_tag_outside_the_users_range_are_refused():
    def fn(comm):
        with pytest.raises(CommError, match="peer 5 is not in a world of size 2"):
            comm.send(np.ones(3), 5)
        with pytest.raises(CommError, match="tag 40000 is outside"):
            comm.send(np.ones(3), 1 - comm.rank, tag=40000)
        with pytest.raises(CommError, match=rf"\[rank {comm.rank}\] send to {1 - comm.rank}: buffer of shape \(4,\) "
                                            r"is not contiguous"):
            comm.isend(np.ones((4, 4))[:, 0], 1 - comm.rank)
        with pytest.raises(CommError, match=rf"\[rank {comm.rank}\] recv from {1 - comm.rank}: expected a numpy"):
            comm.irecv([1.0], 1 - comm.rank)
    ThreadWorld(2).run(fn)


def test_a_collective_with_another_shape_fails_on_the_first_message_without_check_collectives():
    def fn(comm):
        ring_all_reduce(comm, np.ones(10 + (comm.rank == 1)))
    text = run_failing(ThreadWorld(3, check_collectives=False), fn, CollectiveMismatchError)
    assert "ring_all_reduce #0" in text and "rank 1" in text, text
    assert "shape=(11,)" in text and "shape=(10,)" in text, text       # both calls, from the flight records
    assert STALLED not in text, text                                   # at the first message, not the stall threshold


# ---------------------------------------------------------------- out= is checked before a byte moves
@pytest.mark.parametrize("collective, good", [
    (lambda comm, x, out: ring_all_reduce(comm, x, out=out), (12,)),
    (lambda comm, x, out: all_reduce(comm, x, algorithm="recursive_doubling", out=out), (12,)),
    (lambda comm, x, out: all_reduce(comm, x, algorithm="naive", out=out), (12,)),
    (lambda comm, x, out: ring_reduce_scatter(comm, x, out=out), (6,)),
    (lambda comm, x, out: ring_all_gather(comm, x[:6], total=12, out=out), (12,)),
], ids=["ring", "recursive_doubling", "naive", "reduce_scatter", "all_gather"])
def test_out_of_the_wrong_shape_dtype_layout_or_overlapping_the_input_is_refused_before_sending(collective, good):
    def fn(comm):
        x = np.arange(12.0)
        bad = {"shape": np.empty(good[0] + 1), "2-d": np.empty((1,) + good), "dtype": np.empty(good, np.float32),
               "layout": np.empty((good[0], 2))[:, 0], "overlap": x[:good[0]] if good[0] <= 12 else None}
        for what, out in bad.items():
            with pytest.raises(ValueError, match=r"\[rank \d\] .*out must be"):
                collective(comm, x, out)
            assert comm.stats.bytes_sent == 0, what                        # not a byte sent
        out = np.empty(good)
        assert collective(comm, x, out) is out
        return out
    results = ThreadWorld(2).run(fn)
    if good == (12,):                                    # the all-reduces and the all-gather agree everywhere
        assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("algorithm", ALL_REDUCE_ALGORITHMS)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_fills_out_for_every_algorithm_async_too(algorithm, async_op):
    # finding 1 of issue 15: async all_reduce ignored out= for all but the ring (DDP then read zeros)
    def fn(comm):
        x = np.arange(6.0) * (comm.rank + 1)
        out = np.zeros(6)
        got = all_reduce(comm, x, op="mean", algorithm=algorithm, out=out, async_op=async_op)
        got = got.wait() if async_op else got
        return got is out, out
    for same, out in ThreadWorld(4).run(fn):
        assert same
        np.testing.assert_array_equal(out, np.arange(6.0) * 2.5)


def test_an_unknown_algorithm_is_refused_with_the_names():
    def fn(comm):
        with pytest.raises(ValueError, match="'ring', 'recursive_doubling', 'naive', 'auto'"):
            all_reduce(comm, np.ones(3), algorithm="tree")
    ThreadWorld(2).run(fn)


# ---------------------------------------------------------------- check_collectives
def test_a_different_shape_is_named_and_no_rank_returns_a_result():
    returned = {}

    def fn(comm):
        returned[comm.rank] = ring_all_reduce(comm, np.ones(10 + (comm.rank == 2)))
    text = run_failing(ThreadWorld(3), fn, CollectiveMismatchError)
    assert "flight recorder report (check_collectives)" in text, text        # the calls, not just the sizes
    assert "rank 2: ring_all_reduce #0 shape=(11,) float64 88 B op=sum   <-- differs" in text, text
    assert "rank 0: ring_all_reduce #0 shape=(10,)" in text and STALLED not in text, text
    assert returned == {}, returned        # the header is compared before the call returns, on every rank


def test_ranks_that_agree_on_everything_but_the_op_get_no_result():
    # the data of a sum and of a max flow alike: only the header can tell, and the call must not return
    returned = {}

    def fn(comm):
        returned[comm.rank] = ring_all_reduce(comm, np.ones(8), op="max" if comm.rank == 1 else "sum")
    text = run_failing(ThreadWorld(3), fn, CollectiveMismatchError)
    assert "rank 1: ring_all_reduce #0 shape=(8,) float64 64 B op=max   <-- differs" in text, text
    assert returned == {}, returned


def test_a_different_collective_is_named():
    def fn(comm):
        if comm.rank == 1:
            broadcast(comm, np.ones(4), root=0)
        else:
            ring_all_reduce(comm, np.ones(4))
    text = run_failing(ThreadWorld(3), fn, CollectiveMismatchError)
    assert "rank 1: broadcast #0 shape=(4,) float64 32 B root=0   <-- differs" in text, text


# ---------------------------------------------------------------- the flight recorder's verdicts
def test_a_rank_that_skips_a_collective_and_returns_is_named_at_once():
    def fn(comm):
        if comm.rank != 1:
            ring_all_reduce(comm, np.ones(10))
    text = run_failing(ThreadWorld(3), fn, CollectiveMismatchError)
    assert "waits for rank 1, which has returned from fn" in text and "ring_all_reduce #0" in text, text
    assert STALLED not in text, text                         # at once, not at the 10 s stall threshold


def test_a_rank_at_another_call_is_named_at_the_stall_threshold_without_check_collectives():
    def fn(comm):
        if comm.rank == 1:
            comm.barrier()                               # the others all-reduce: the tags never match
        else:
            ring_all_reduce(comm, np.ones(10))
    text = run_failing(ThreadWorld(3, comm_timeout=0.3, check_collectives=False), fn, CollectiveMismatchError)
    assert "flight recorder report" in text and "rank(s) [1] called barrier #0" in text, text
    assert "rank 1: in barrier #0" in text and "<-- differs" in text, text


def test_a_slow_rank_is_named_in_a_warning_and_waited_for(capsys):
    def fn(comm):
        if comm.rank == 1:
            time.sleep(1.0)                              # computing, as far as anyone can tell
        return ring_all_reduce(comm, np.ones(4))[0]
    assert ThreadWorld(3, comm_timeout=0.3, timeout=10).run(fn) == [3.0] * 3
    err = capsys.readouterr().err
    assert err.count("warning: flight recorder report") == 1, err    # one rank reports, not three
    assert "rank 1: computing" in err and "have not reached ring_all_reduce #0" in err, err
    assert "up to the hard timeout (10 s)" in err


def test_a_rank_that_never_comes_ends_the_run_at_the_hard_timeout_naming_it():
    def fn(comm):
        if comm.rank == 1:
            time.sleep(3)
        ring_all_reduce(comm, np.ones(4))
    text = run_failing(ThreadWorld(3, comm_timeout=0.2, timeout=0.6), fn, CollectiveTimeout)
    assert "rank 1: computing" in text and "Ending the job (hard timeout)" in text, text    # not after its 3 s


def test_two_ranks_waiting_for_each_other_in_different_calls_are_a_deadlock():
    def fn(comm):
        if comm.rank == 0:
            comm.recv(np.empty(3), 1, tag=1)
        else:
            comm.recv(np.empty(3), 0, tag=2)
    text = run_failing(ThreadWorld(2, comm_timeout=0.3), fn, CollectiveMismatchError)
    assert "wait for each other in different calls (a deadlock)" in text and "rank 0" in text and "rank 1" in text


def test_a_deadlock_over_a_tag_that_differs_names_the_tags():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.ones(3), 1, tag=1)
            comm.recv(np.empty(3), 1, tag=3)
        else:
            comm.recv(np.empty(3), 0, tag=2)
    text = run_failing(ThreadWorld(2, comm_timeout=0.3), fn, CollectiveMismatchError)
    assert "(a deadlock): rank 1 waits to receive tag 2 from rank 0, whose send(s) to it with tag 1 were never " \
           "received (the tags differ)" in text, text


def test_a_split_that_one_rank_never_calls_cannot_hang():
    def fn(comm):
        if comm.rank != 2:
            DeviceMesh(comm, dp=2, tp=2)
    text = run_failing(ThreadWorld(4), fn, CollectiveMismatchError)
    assert "rank 2, which has returned from fn" in text and STALLED not in text, text


def test_run_does_not_wait_without_bound_for_a_rank_that_never_returns():
    def fn(comm):
        if comm.rank == 1:
            time.sleep(5)                                # no communication: nothing times out inside
    text = run_failing(ThreadWorld(2, timeout=0.5), fn, CollectiveTimeout)
    assert "rank(s) [1] still running" in text, text          # a run that waited its 5 s would return


def test_each_rank_records_its_last_calls():
    def fn(comm):
        for _ in range(100):
            ring_all_reduce(comm, np.ones(8, np.float32))
        broadcast(comm, np.ones((2, 3)), root=0)
        return comm.recorder.snapshot()
    snap = ThreadWorld(2).run(fn)[0]
    records = snap["records"]
    assert len(records) == 64                            # a bounded ring of the last calls
    last = records[-1]
    assert (last["name"], last["seq"], last["shape"], last["dtype"], last["nbytes"], last["state"]) == \
        ("broadcast", 100, (2, 3), "float64", 48, "done")
    assert last["start"] <= last["end"] and snap["next_seq"] == {"world": 101}
    assert [r["seq"] for r in records[:-1]] == list(range(37, 100))


def test_a_mismatch_on_a_mesh_axis_names_the_axis_and_its_ranks():
    def fn(comm):
        mesh = DeviceMesh(comm, dp=2, tp=2)
        tp = mesh.comm("tp")
        ring_all_reduce(tp, np.ones(3 + (comm.rank == 3)))
    text = run_failing(ThreadWorld(4), fn, CollectiveMismatchError)
    assert "collective #0 on tp[2, 3] differs" in text and "rank 3: ring_all_reduce #0 shape=(4,)" in text, text


def test_a_receive_of_another_dtype_is_named_even_when_the_sender_waits_for_the_receiver():
    # MPI (the dtype travels in the tag: the messages never match): rank 0 sent float32 with tag 7
    # and waits in a barrier for rank 1, whose float64 receive with tag 7 waits for rank 0. A wait
    # cycle; whichever rank reports, the verdict names the cause, not just "a deadlock"
    from minitrain.comm.flight_verdict import analyze
    recorders = [FlightRecorder(0), FlightRecorder(1)]
    send = recorders[0].open("world", -1, "send", (4,), "float32", 16, peer=1, tag=7)
    recorders[0].close(send)
    barrier = recorders[0].open("world", 2, "barrier", None, None, 0)
    barrier.waiting_for, barrier.wait_since = [1], barrier.start
    recv = recorders[1].open("world", -1, "recv", (2,), "float64", 16, peer=0, tag=7)
    recv.waiting_for, recv.wait_since = [0], recv.start
    snaps = {r: recorders[r].snapshot() for r in (0, 1)}
    for asker, call in ((0, barrier), (1, recv)):
        verdict = analyze(asker, call.as_dict(), [0, 1] if asker == 0 else [0, 1], snaps)
        assert verdict.kind == "mismatch" and verdict.culprits == [0, 1], verdict.text
        assert re.search(r"rank 1 recvs float64 16 B \(16 bytes\) with tag 7, rank 0 sends float32 16 B", verdict.text), \
            verdict.text


def test_a_rank_late_to_finish_a_collective_its_peer_has_finished_is_not_a_deadlock():
    # seen at --comm-timeout 0.05 on 2 busy cores: the root of broadcast #1 has sent and gone on to #2, waiting
    # there for rank 1, which has not yet seen #1's message land. Each waits for the other, but rank 1's wait
    # ends by itself: no deadlock (that verdict ended a healthy job), a slow rank named in a warning
    from minitrain.comm.flight_verdict import analyze
    recorders = [FlightRecorder(0), FlightRecorder(1)]
    recorders[0].close(recorders[0].open("world", 1, "broadcast", (3,), "float64", 24, None, 0))
    ahead = recorders[0].open("world", 2, "broadcast", (3,), "float64", 24, None, 0)
    late = recorders[1].open("world", 1, "broadcast", (3,), "float64", 24, None, 0)
    for call, peer in ((ahead, 1), (late, 0)):
        call.waiting_for, call.wait_since = [peer], call.start
    snaps = {r: recorders[r].snapshot() for r in (0, 1)}
    verdict = analyze(0, ahead.as_dict(), [0, 1], snaps)
    assert (verdict.kind, verdict.fatal) == ("slow", False) and "rank(s) [1] have not reached broadcast #2" in \
        verdict.text, verdict.text
    assert not analyze(1, late.as_dict(), [0, 1], snaps).fatal


def test_a_header_decodes_to_its_own_call_when_the_same_signature_was_encoded_before():
    # headers are built once per signature and copied: each copy must still carry its own call's
    # sequence number, and another op or shape must not reuse the first one's header
    from minitrain.comm.flight_recorder import Record
    from minitrain.comm.headers import decode_header, encode_header

    def record(seq, op="sum", shape=(3, 4)):
        return Record("world", seq, "ring_all_reduce", shape, "float64", 96, op, None, None, None, "running")
    first, again = encode_header(record(7)), encode_header(record(8))
    assert decode_header(first, "world")["seq"] == 7 and decode_header(again, "world")["seq"] == 8
    assert decode_header(encode_header(record(9, op="max")), "world")["op"] == "max"
    assert decode_header(encode_header(record(10, shape=(12,))), "world")["shape"] == (12,)
    assert decode_header(encode_header(record(7)), "world")["seq"] == 7 and first[1] == 7

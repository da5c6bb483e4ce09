"""The communication layer in-process (ThreadWorld): every collective exact on awkward sizes and
dtypes, bytes equal to the formulas, async work, mesh, tracing. Faults, the receive contract and
the flight recorder: tests/test_flight_recorder.py."""
import json
import math
import re
import time

import numpy as np
import pytest

from minitrain import trace
from minitrain.comm import (CommError, DeviceMesh, MeshError,
                            ThreadWorld, all_reduce, all_reduce_coalesced, all_to_all, broadcast, chunk_bounds,
                            naive_all_reduce, reduce,
                            recursive_doubling_all_reduce, ring_all_gather, ring_all_reduce,
                            ring_reduce_scatter)
from minitrain.comm.checks import run_all


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_collective_is_exact_on_threadworld(p):
    counts = ThreadWorld(p).run(run_all)
    assert all(c == counts[0] for c in counts) and sum(counts[0].values()) > 500


def chunk(n, p, i):
    b = chunk_bounds(n, p)
    return b[i + 1] - b[i]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("n", [1024, 1001])
def test_ring_bytes_per_rank_equal_the_formulas(p, n):
    def fn(comm):
        x = np.ones(n, np.float32)
        ring_all_reduce(comm, x)
        ring_reduce_scatter(comm, x)
        ring_all_gather(comm, np.ones(chunk(n, p, comm.rank), np.float32), total=n)
        return {k: comm.stats[k]["bytes_sent"] for k in ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather")}
    for r, sent in enumerate(ThreadWorld(p).run(fn)):
        rs = (n - chunk(n, p, r)) * 4
        ag = (n - chunk(n, p, (r + 1) % p)) * 4
        assert sent == {"ring_all_reduce": rs + ag, "ring_reduce_scatter": rs, "ring_all_gather": ag}
        if n % p == 0:
            assert sent["ring_all_reduce"] == 2 * (p - 1) / p * n * 4
            assert sent["ring_reduce_scatter"] == sent["ring_all_gather"] == (p - 1) / p * n * 4


@pytest.mark.parametrize("p", [2, 4])
def test_naive_and_recursive_doubling_bytes(p):
    n = 1000

    def fn(comm):
        naive_all_reduce(comm, np.ones(n))
        recursive_doubling_all_reduce(comm, np.ones(n))
        return comm.stats["naive_all_reduce"]["bytes_sent"], comm.stats["recursive_doubling_all_reduce"]["bytes_sent"]
    sent = ThreadWorld(p).run(fn)
    assert sent[0][0] == (p - 1) * n * 8                 # the root sends the result to everyone
    assert all(s[0] == n * 8 for s in sent[1:])
    assert all(s[1] == math.log2(p) * n * 8 for s in sent)


def test_collectives_leave_the_input_untouched_and_return_new_arrays():
    def fn(comm):
        x = np.arange(5.0)
        y = ring_all_reduce(comm, x)
        return x, y
    for x, y in ThreadWorld(2).run(fn):
        assert np.array_equal(x, np.arange(5.0)) and y is not x


def test_auto_picks_recursive_doubling_small_and_ring_large():
    def fn(comm):
        all_reduce(comm, np.ones(10, np.float32))
        all_reduce(comm, np.ones(1 << 16, np.float32))
        return comm.stats["recursive_doubling_all_reduce"]["calls"], comm.stats["ring_all_reduce"]["calls"]
    assert ThreadWorld(2).run(fn) == [(1, 1), (1, 1)]


@pytest.mark.parametrize("p", [2, 3])
def test_all_reduce_coalesced_equals_one_all_reduce_per_array_in_one_message(p):
    shapes = [(3, 4), (5,), (), (2, 1, 3)]

    def fn(comm):
        rng = np.random.default_rng(comm.rank)
        arrays = [rng.standard_normal(s) for s in shapes]
        separate = [all_reduce(comm, a, op="mean", algorithm="ring") for a in arrays]
        before = comm.stats["ring_all_reduce"]["calls"]
        all_reduce_coalesced(comm, arrays, op="mean", algorithm="ring")
        with pytest.raises(TypeError, match="one dtype"):
            all_reduce_coalesced(comm, [np.ones(2), np.ones(2, np.float32)])
        return arrays, separate, comm.stats["ring_all_reduce"]["calls"] - before
    for arrays, separate, calls in ThreadWorld(p).run(fn):
        assert calls == 1                                    # one message for all the arrays
        for a, s, shape in zip(arrays, separate, shapes):    # in place, each in its own shape
            assert a.shape == shape and np.allclose(a, s, rtol=0, atol=1e-15)


def test_async_collectives_overlap_with_work_and_finish_in_order():
    def fn(comm):
        works = [all_reduce(comm, np.full(50_000, i + 1.0), async_op=True) for i in range(4)]
        blocking = ring_all_reduce(comm, np.ones(3))
        results = [w.wait() for w in works]
        return [r[0] for r in results], blocking[0], all(w.is_completed() for w in works)
    for values, blocking, done in ThreadWorld(3).run(fn):
        assert values == [3.0, 6.0, 9.0, 12.0] and blocking == 3.0 and done


def test_async_error_is_raised_at_wait():
    def fn(comm):
        work = ring_all_reduce(comm, np.ones(3), op="mean", async_op=True)
        assert work.wait()[0] == 1.0
        with pytest.raises(ValueError):
            ring_all_reduce(comm, np.ones(3), op="product")
        with pytest.raises(TypeError, match="floating"):
            ring_all_reduce(comm, np.ones(3, np.int64), op="mean")
    ThreadWorld(2).run(fn)


def test_mesh_axes_group_the_right_ranks():
    def fn(comm):
        mesh = DeviceMesh(comm, dp=2, pp=2, tp=2)
        sums = {axis: int(ring_all_reduce(mesh.comm(axis), np.array([comm.rank]))[0]) for axis in ("tp", "dp", "pp")}
        return mesh.coords, sums, mesh.ranks_along("tp"), mesh.describe()
    results = ThreadWorld(8).run(fn)
    coords, sums, tp_ranks, text = results[5]          # rank 5 = pp 1, dp 0, tp 1
    assert coords == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}        # cp = 1: the 3-axis placement
    assert tp_ranks == [4, 5]                          # tp neighbours are adjacent ranks
    assert sums == {"tp": 4 + 5, "dp": 5 + 7, "pp": 1 + 5}
    assert "dp 1: tp ranks [  6   7 ]" in text


def test_mesh_cp_axis_sits_between_dp_and_tp_and_joins_dp_and_tp():
    def fn(comm):
        mesh = DeviceMesh(comm, dp=2, cp=2, tp=2)
        sums = {axis: int(ring_all_reduce(mesh.comm(axis), np.array([comm.rank]))[0])
                for axis in ("tp", "cp", "dp", "dp_cp", "cp_tp")}
        return (mesh.coords, sums, mesh.ranks_along("dp_cp"), mesh.comm("dp_cp").rank, mesh.describe(),
                mesh.ranks_along("cp_tp"), mesh.comm("cp_tp").rank)
    coords, sums, joint, joint_rank, text, cp_tp, cp_tp_rank = ThreadWorld(8).run(fn)[5]   # rank 5 = dp 1, cp 0, tp 1
    assert coords == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert sums == {"tp": 4 + 5, "cp": 5 + 7, "dp": 1 + 5, "dp_cp": 1 + 3 + 5 + 7, "cp_tp": 4 + 5 + 6 + 7}
    assert joint == [1, 3, 5, 7] and joint_rank == 2        # ordered by (dp, cp)
    assert cp_tp == [4, 5, 6, 7] and cp_tp_rank == 1        # ordered by (cp, tp): a row's pieces in sequence order
    assert "dp 1 cp 1: tp ranks [  6   7 ]" in text and "cp=2" in text.splitlines()[0]


def test_mesh_that_does_not_fit_the_world_is_a_clear_error():
    def fn(comm):
        with pytest.raises(MeshError, match="does not fit a world of 4"):
            DeviceMesh(comm, dp=3, tp=2)
        with pytest.raises(TypeError, match="positional argument"):     # torch's (shape, names): axes by name here
            DeviceMesh(comm, (2, 2), ("dp", "tp"))
        with pytest.raises(TypeError, match="positional argument"):     # pp 2 x dp 2, or dp 2 x pp 2?
            DeviceMesh(comm, 2, 2)
    ThreadWorld(4).run(fn)


def test_split_orders_by_key():
    def fn(comm):
        sub = comm.split(color=comm.rank % 2, key=-comm.rank)
        return sub.rank, sub.size
    assert ThreadWorld(4).run(fn) == [(1, 2), (1, 2), (0, 2), (0, 2)]


def test_isend_and_irecv_return_handles_with_torch_s_wait_and_is_completed():
    def fn(comm):
        if comm.rank == 0:
            time.sleep(0.05)                         # the receive is posted, and tested, before the send
            return comm.isend(np.arange(4.0), 1, tag=7).wait()
        buf = np.zeros(4)
        request = comm.irecv(buf, 0, tag=7)
        early = request.is_completed()
        assert request.wait() is True and request.is_completed()
        with pytest.raises(CommError, match=r"\[rank 1\] recv from rank 0 \(tag 8\).*16 bytes.*expected 24 bytes"):
            comm.irecv(np.zeros(3), 0, tag=8).wait()
        return early, buf.tolist()

    def sender(comm, fn=fn):
        result = fn(comm)
        if comm.rank == 0:
            comm.send(np.zeros(2), 1, tag=8)         # a message of another size than the receive's
        return result
    assert ThreadWorld(2).run(sender) == [True, (False, [0.0, 1.0, 2.0, 3.0])]


def test_split_refuses_a_color_or_key_that_is_not_an_integer_on_the_rank_that_passed_it():
    """torch's new_group leaves non-members out; MPI's split has every rank join a group: None (or 1.5, which
    int() would have cut to 1, joining another group) is refused by name, before any rank waits."""
    def fn(comm):
        for color, key in ((None, None), (1.5, None), (0, "a")):
            with pytest.raises(CommError, match=rf"\[rank {comm.rank}\] split: (color|key) must be an integer"):
                comm.split(color, key)
        return comm.split(np.int64(comm.rank // 2)).size
    assert ThreadWorld(4).run(fn) == [2, 2, 2, 2]


def test_a_rank_that_raises_stops_the_others_quickly():
    def fn(comm):
        if comm.rank == 1:
            raise KeyError("injected")
        ring_all_reduce(comm, np.ones(10))
    world = ThreadWorld(3, timeout=60)
    with pytest.raises(KeyError) as err:
        world.run(fn)
    assert "raised on rank 1" in str(err.value.__notes__)
    # stopped by rank 1's failure at their first wait, not by a stall report at the comm timeout
    assert all("stopped waiting for rank" in world.recorders[r].detail and "rank 1 failed" in world.recorders[r].detail
               for r in (0, 2)), [world.recorders[r].detail for r in (0, 2)]


def test_each_rank_keeps_its_own_memory_account():
    world = ThreadWorld(2)

    def fn(comm):
        from minitrain import nn
        model = nn.Linear(10 * (comm.rank + 1), 10)
        return model, world.trackers[comm.rank].live["params"]
    results = world.run(fn)
    assert [r[1] for r in results] == [440, 840]


def test_each_rank_draws_from_its_own_generator_started_like_a_process():
    """As MPI processes seeded alike: every rank draws the same numbers, reseeding one rank does
    not move the others, and the caller's generator is not advanced."""
    import minitrain as mt
    from minitrain import random
    mt.manual_seed(5)
    expected = random.rand(4)
    mt.manual_seed(5)

    def fn(comm):
        first = random.rand(4)
        if comm.rank == 1:
            mt.manual_seed(99)
        comm.barrier()
        return first, random.rand(4)
    results = ThreadWorld(3).run(fn)
    assert all(np.array_equal(first, expected) for first, _ in results)
    assert np.array_equal(results[0][1], results[2][1]) and not np.array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(random.rand(4), expected)


def test_trace_records_collectives_and_writes_one_chrome_file(tmp_path):
    path = tmp_path / "trace.json"

    def fn(comm):
        trace.enable(rank=comm.rank)
        with trace.span("compute"):
            time.sleep(0.001)
        ring_all_reduce(comm, np.ones(100))
        trace.save_chrome(str(path), comm)
        trace.disable()
    ThreadWorld(3).run(fn)
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2}
    assert {e["name"] for e in spans} >= {"compute", "ring_all_reduce"}



def test_out_buffers_are_filled_in_place_and_checked():
    def fn(comm):
        x = np.arange(10.0) + comm.rank
        out, shard_out, gathered = np.empty(10), np.empty(chunk(10, comm.size, comm.rank)), np.empty(10)
        assert ring_all_reduce(comm, x, out=out) is out
        assert all_reduce(comm, x, out=np.empty(10)).sum() == out.sum()
        assert ring_reduce_scatter(comm, x, out=shard_out) is shard_out
        assert ring_all_gather(comm, shard_out, total=10, out=gathered) is gathered
        with pytest.raises(ValueError, match="out must be"):
            ring_all_reduce(comm, x, out=np.empty(9))
        return out, gathered
    for out, gathered in ThreadWorld(3).run(fn):
        np.testing.assert_array_equal(out, 3 * np.arange(10.0) + 3)
        np.testing.assert_array_equal(gathered, out)


def read_only(a):
    a.flags.writeable = False
    return a


def test_a_read_only_buffer_is_refused_where_a_call_would_write_before_anything_moves():
    """A receive, an out= and a broadcast's buffer off the root are written into: a read-only NumPy array there is
    refused by name on the rank that passed it (mpi4py said "dlpack: buffer is not writable", or the copy of the
    result failed after the data had moved); the root's own broadcast buffer is only read, and may be read-only."""
    def fn(comm):
        peer = 1 - comm.rank
        with pytest.raises(CommError, match=rf"\[rank {comm.rank}\] recv from {peer}: buffer of shape \(3,\) is "
                                            r"read-only, and a receive writes into it"):
            comm.irecv(read_only(np.empty(3)), peer, tag=1)
        with pytest.raises(ValueError, match=rf"\[rank {comm.rank}\] ring_all_reduce: out must be a contiguous, "
                                             r"writeable .*: it is read-only"):
            ring_all_reduce(comm, np.ones(4), out=read_only(np.empty(4)))
        if comm.rank == 1:          # (the root does not call: nothing is sent)
            with pytest.raises(ValueError, match=r"\[rank 1\] broadcast: the buffer is read-only \(every rank but "
                                                 r"the root's is filled in place\)"):
                broadcast(comm, read_only(np.empty(2)), root=0)
        x = read_only(np.full(2, 7.0)) if comm.rank == 0 else np.zeros(2)
        broadcast(comm, x, root=0)
        comm.send(np.arange(3.0), peer, tag=2)      # the refused receive posted nothing: the next one is whole
        return x, comm.recv(np.empty(3), peer, tag=2)
    for x, received in ThreadWorld(2).run(fn):
        np.testing.assert_array_equal(x, [7.0, 7.0])
        np.testing.assert_array_equal(received, np.arange(3.0))


def test_a_reduction_takes_numbers_and_no_message_carries_python_objects():
    """A reduction of strings was NumPy's string addition truncated into the buffer ("ab" summed over 2 ranks read
    "ab"), of dates or records an error from inside the ring; an object array's pointers, sent to another process
    and added there, crashed it (SIGSEGV). Each is refused by name before anything moves; strings and records still
    travel where nothing is added (broadcast, all-gather, all-to-all)."""
    record = np.dtype([("a", "f8"), ("b", "i4")])

    def fn(comm):
        for x in (np.array(["ab", "cd"]), np.zeros(2, record), np.array(["2020-01-01"] * 2, "datetime64[D]")):
            for collective in (all_reduce, ring_reduce_scatter, reduce):
                with pytest.raises(TypeError, match=rf"\[rank {comm.rank}\] \w+: op='sum' reduces numbers, and "
                                                    rf"{re.escape(str(x.dtype))} is not a number type"):
                    collective(comm, x)
        objects = np.array([1, "a"], object)
        for collective in (broadcast, all_to_all, ring_all_gather):
            with pytest.raises(TypeError, match=rf"\[rank {comm.rank}\] {collective.__name__}: dtype object holds "
                                                r"Python objects, whose pointers mean nothing in another process"):
                collective(comm, objects)
        with pytest.raises(CommError, match=rf"\[rank {comm.rank}\] send to {1 - comm.rank}: buffer of shape \(2,\) "
                                            r"holds Python objects"):
            comm.isend(objects, 1 - comm.rank, tag=3)
        words = np.array(["ab", "cd"]) if comm.rank == 0 else np.array(["zz", "zz"])
        broadcast(comm, words, root=0)
        mine = np.zeros(1, record)
        mine["a"] = comm.rank
        return words.tolist(), ring_all_gather(comm, mine, total=2)["a"].tolist()
    assert ThreadWorld(2).run(fn) == [(["ab", "cd"], [0.0, 1.0])] * 2


@pytest.mark.parametrize("collective", [all_reduce, ring_all_reduce, ring_reduce_scatter, ring_all_gather, broadcast,
                                        reduce, naive_all_reduce, recursive_doubling_all_reduce, all_to_all])
@pytest.mark.parametrize("value", [2.0, [1.0, 2.0]])
def test_a_collective_refuses_what_is_not_an_array_by_name_on_every_rank(collective, value):
    """As torch.distributed refuses what is not a Tensor: a clear TypeError on the rank that called it, not an
    AttributeError from inside the algorithm (or a wait for ranks that were refused)."""
    def fn(comm):
        with pytest.raises(TypeError, match=rf"\[rank {comm.rank}\] {collective.__name__}: expected an array "
                                            rf"\(NumPy or CuPy\), got {type(value).__name__}"):
            collective(comm, value)
        with pytest.raises(TypeError, match="all_reduce_coalesced: expected an array"):
            all_reduce_coalesced(comm, [np.ones(2), value])
        return True
    assert ThreadWorld(2).run(fn) == [True, True]


def test_prod_reduces_on_every_collective_that_reduces():
    """PyTorch's ReduceOp.PRODUCT (MPI_PROD): products of small integers are exact in any order."""
    def fn(comm):
        x = np.array([1, -2, 3, 0, 5], np.int64) + comm.rank
        return [all_reduce(comm, x, op="prod", algorithm=a) for a in ("ring", "recursive_doubling", "naive")] + [
            ring_reduce_scatter(comm, x, op="prod"), reduce(comm, x, root=2, op="prod")]
    want = np.prod([np.array([1, -2, 3, 0, 5]) + r for r in range(3)], axis=0)
    for rank, results in enumerate(ThreadWorld(3).run(fn)):
        for got in results[:3]:
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(results[3], np.array_split(want, 3)[rank])
        assert (results[4] is None) == (rank != 2) and (rank != 2 or np.array_equal(results[4], want))


@pytest.mark.parametrize("op, dtype, error, needle", [
    ("max", np.complex128, TypeError, "op='max' on complex128: complex numbers have no order"),
    ("min", np.complex64, TypeError, "op='min' on complex64: complex numbers have no order"),
    ("mean", np.int32, TypeError, "op='mean' needs a floating dtype, got int32"),
    ("avg", np.float64, ValueError, "unknown op 'avg'.*PyTorch's ReduceOp.AVG is op='mean'"),
    ("PRODUCT", np.float64, ValueError, "unknown op 'PRODUCT'.*PyTorch's ReduceOp.PRODUCT is op='prod'"),
])
@pytest.mark.parametrize("collective", [all_reduce, ring_reduce_scatter, reduce, naive_all_reduce])
def test_an_op_the_dtype_cannot_take_is_refused_naming_the_rank_and_the_call(collective, op, dtype, error, needle):
    """As MPI and PyTorch refuse MAX / MIN of complex numbers (NumPy would order them lexicographically: a
    number nobody asked for), before any rank waits."""
    def fn(comm):
        with pytest.raises(error, match=rf"\[rank {comm.rank}\] \w*{collective.__name__}: {needle}"):
            collective(comm, np.ones(3, dtype), op=op)
        return True
    assert ThreadWorld(2).run(fn) == [True, True]


def test_broadcast_s_refusals_name_the_rank():
    def fn(comm):
        with pytest.raises(ValueError, match=rf"\[rank {comm.rank}\] broadcast: the buffer must be contiguous"):
            broadcast(comm, np.zeros((3, 2)).T)
        with pytest.raises(ValueError, match=rf"\[rank {comm.rank}\] broadcast: root 2 is not in a world of size 2"):
            broadcast(comm, np.zeros(3), root=2)
        return True
    assert ThreadWorld(2).run(fn) == [True, True]


def test_reduce_scatter_with_uneven_bounds():
    bounds = [0, 0, 5, 6, 9]                       # rank 0 gets nothing, rank 1 five elements, ...

    def fn(comm):
        x = np.arange(9.0) * (comm.rank + 1)
        return ring_reduce_scatter(comm, x, bounds=bounds)
    for r, got in enumerate(ThreadWorld(4).run(fn)):
        np.testing.assert_array_equal(got, (np.arange(9.0) * 10)[bounds[r]:bounds[r + 1]])


@pytest.mark.parametrize("check", [True, False])
def test_totals_count_the_algorithms_bytes_and_the_headers_apart(check):
    def fn(comm):
        comm.check_collectives = check
        ring_all_reduce(comm, np.ones(1000, np.float32))
        s = comm.stats
        return (s.bytes_sent, s.bytes_received, s.messages_sent, s.messages_received,
                s["check_collectives"]["messages_sent"], s["check_collectives"]["messages_received"],
                s["ring_all_reduce"]["bytes_received"])
    for result in ThreadWorld(2).run(fn):
        # p = 2: half the array each way in the reduce-scatter, half in the all-gather; one header each way
        assert result == (4000, 4000, 2, 2, int(check), int(check), 4000)

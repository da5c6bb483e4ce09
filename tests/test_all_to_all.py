"""all_to_all_single (comm/alltoallv.py): uneven splits on ThreadWorld at p = 1..4 against the
definition, the sizes exchange, exact byte counts, the errors; and under mpiexec at p = 2, 3, 4
against MPI's Alltoallv (tests/programs/alltoallv_check.py)."""
import sys

import numpy as np
import pytest

from minitrain.comm import CollectiveMismatchError, ThreadWorld, Work, all_to_all_single
from minitrain.testing import run_mpi

PROGRAM = __import__("pathlib").Path(__file__).parent / "programs" / "alltoallv_check.py"


def splits(rank, p):
    """Awkward sizes: rank r sends (r + 2j) % 4 rows to rank j (zeros included, uneven)."""
    return [(rank + 2 * j) % 4 for j in range(p)]


def rows(rank, n, row_shape=(), dtype=np.float64):
    """Rows that say where they came from: rank·1000 + row index (+ a position within the row)."""
    per_row = int(np.prod(row_shape))
    x = rank * 1000 + np.arange(n)[:, None] * 10 + np.arange(per_row)[None, :]
    return x.reshape((n,) + row_shape).astype(dtype)


def expected(rank, p, sizes, row_shape=(), dtype=np.float64):
    """The rows every rank sends to ``rank``, stacked in rank order (the definition)."""
    parts = []
    for i in range(p):
        s = sizes(i, p)
        start = sum(s[:rank])
        parts.append(rows(i, sum(s), row_shape, dtype)[start:start + s[rank]])
    return np.concatenate(parts)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("row_shape,dtype", [((), np.float64), ((2, 3), np.int32), ((5,), np.float16)])
def test_uneven_and_zero_size_splits_give_every_rank_the_rows_sent_to_it(p, row_shape, dtype):
    def fn(comm):
        mine = splits(comm.rank, p)
        theirs = [splits(i, p)[comm.rank] for i in range(p)]
        got = all_to_all_single(comm, rows(comm.rank, sum(mine), row_shape, dtype), theirs, mine)
        return got, comm.stats.bytes_sent
    row_bytes = int(np.prod(row_shape)) * np.dtype(dtype).itemsize
    for r, (got, sent) in enumerate(ThreadWorld(p).run(fn)):
        want = expected(r, p, splits, row_shape, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape and got.flags.c_contiguous
        assert np.array_equal(got, want), f"rank {r}"
        # bytes counted: the rows sent to other ranks, never the own block
        assert sent == (sum(splits(r, p)) - splits(r, p)[r]) * row_bytes, f"rank {r}"


@pytest.mark.parametrize("check", [True, False])
def test_without_output_sizes_the_ranks_exchange_their_counts_first(check):
    p = 3

    def fn(comm):
        mine = splits(comm.rank, p)
        got = all_to_all_single(comm, rows(comm.rank, sum(mine), (2,)), input_split_sizes=mine)
        return got, comm.stats.bytes_sent, comm.stats["all_to_all_single sizes"]["messages_sent"]
    for r, (got, sent, size_messages) in enumerate(ThreadWorld(p, check_collectives=check).run(fn)):
        assert np.array_equal(got, expected(r, p, splits, (2,))), f"rank {r}"
        assert sent == (sum(splits(r, p)) - splits(r, p)[r]) * 16       # the counts are counted apart
        assert size_messages == (0 if check else p - 1)   # under the guard its gather gives the sizes


def test_equal_blocks_by_default_and_async_returns_a_work():
    def fn(comm):
        x = rows(comm.rank, 2 * comm.size)
        work = all_to_all_single(comm, x, async_op=True)
        assert isinstance(work, Work)
        return work.wait()
    for r, got in enumerate(ThreadWorld(4).run(fn)):
        assert np.array_equal(got, expected(r, 4, lambda i, p: [2] * p))


def test_the_pairwise_exchange_matches_the_equal_block_all_to_all():
    from minitrain.comm import all_to_all

    def fn(comm):
        x = rows(comm.rank, 3 * comm.size, (2,))
        return all_to_all_single(comm, x), all_to_all(comm, x)
    for a, b in ThreadWorld(3).run(fn):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_split_sizes_that_disagree_are_named_on_every_rank_with_both_sizes(p):
    def fn(comm):
        mine = splits(comm.rank, p)
        theirs = [splits(i, p)[comm.rank] for i in range(p)]
        if comm.rank == p - 1:
            theirs[0] += 1          # rank p-1 expects one row more from rank 0 than rank 0 sends
        try:
            all_to_all_single(comm, rows(comm.rank, sum(mine)), theirs, mine)
        except CollectiveMismatchError as e:
            return str(e)
        return None
    sent = splits(0, p)[p - 1]
    for r, text in enumerate(ThreadWorld(p, comm_timeout=2.0).run(fn)):
        assert text is not None, f"rank {r} did not raise"
        assert f"rank 0 sends {sent} rows to rank {p - 1}, which expects {sent + 1} from rank 0" in text


def test_a_disagreement_about_exchanging_the_sizes_is_a_header_mismatch():
    def fn(comm):
        mine = splits(comm.rank, 2)
        theirs = [splits(i, 2)[comm.rank] for i in range(2)]
        all_to_all_single(comm, rows(comm.rank, sum(mine)), theirs if comm.rank else None, mine)
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: all_to_all_single #0 shape=\(\) .* sizes_exchanged=1"):
        ThreadWorld(2, comm_timeout=2.0).run(fn)


@pytest.mark.parametrize("kwargs,message", [
    ({"input_split_sizes": [1, 2]}, r"input_split_sizes must be 3 non-negative integers, summing to the 5 rows"),
    ({"input_split_sizes": [3, 3, -1]}, r"input_split_sizes must be .* got \[3, 3, -1\]"),
    ({"input_split_sizes": [1, 1, 1]}, r"summing to the 5 rows of x, got \[1, 1, 1\]"),
    ({"input_split_sizes": [5, 0, 0], "output_split_sizes": [1, 1]}, r"output_split_sizes must be 3"),
    ({"input_split_sizes": [5, 0, 0], "output_split_sizes": [1, -1, 1]}, r"output_split_sizes .* got \[1, -1, 1\]"),
    ({"input_split_sizes": [2.5, 2.5, 0]}, r"input_split_sizes must be 3 integers, got \[2.5, 2.5, 0\]"),
    ({"input_split_sizes": 5}, r"input_split_sizes must be 3 integers, got 5"),
    ({}, r"5 rows do not divide into 3 equal blocks; pass input_split_sizes"),
])
def test_bad_split_sizes_are_one_clear_error_naming_the_rank_and_the_call(kwargs, message):
    def fn(comm):
        all_to_all_single(comm, np.zeros((5, 2)), **kwargs)
    with pytest.raises(ValueError, match=r"\[rank \d\] all_to_all_single: .*" + message):
        ThreadWorld(3).run(fn)


def test_device_arrays_stay_on_the_device(standin_gpu):
    cp = standin_gpu

    def fn(comm):
        mine = splits(comm.rank, 3)
        x = cp.asarray(rows(comm.rank, sum(mine), (2,)))
        before = dict(cp._standin.counters())
        got = all_to_all_single(comm, x, input_split_sizes=mine)
        after = cp._standin.counters()
        assert isinstance(got, cp.ndarray)
        return cp.asnumpy(got), {k: after[k] - before[k] for k in ("h2d", "d2h", "h2d_implicit", "sync")}
    for r, (got, moved) in enumerate(ThreadWorld(3).run(fn)):
        assert np.array_equal(got, expected(r, 3, splits, (2,)))
        assert moved == {"h2d": 0, "d2h": 0, "h2d_implicit": 0, "sync": 0}, moved


def test_awkward_sizes_match_mpi_alltoallv_at_p_2_3_4():
    for p in (2, 3, 4):
        result = run_mpi([sys.executable, str(PROGRAM)], n=p, timeout=180)
        for r in range(p):
            assert f"rank {r} of {p}: alltoallv" in result.stdout, result.stdout

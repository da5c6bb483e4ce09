"""all_to_all_single against MPI's Alltoallv on awkward sizes (run by tests/test_all_to_all.py under
mpiexec at p = 2, 3, 4): zero-size splits, a rank that sends nothing, uneven random sizes, rows of
several shapes and dtypes, the sizes exchange (output_split_sizes=None), async, with and without
check_collectives; split sizes that disagree raise on every rank. Every rank prints
``rank r of p: alltoallv N cases agree``."""
import numpy as np

from minitrain.comm import CollectiveMismatchError, all_to_all_single, init


def send_table(case, p):
    """table[i][j]: rows rank i sends to rank j (the same table on every rank)."""
    if case == "zeros":
        return [[(i + 2 * j) % 4 for j in range(p)] for i in range(p)]
    if case == "silent_rank":                 # rank 0 sends nothing, the last rank receives nothing
        return [[0 if i == 0 or j == p - 1 else i + j + 1 for j in range(p)] for i in range(p)]
    if case == "empty":
        return [[0] * p for _ in range(p)]
    rng = np.random.default_rng(sum(map(ord, case)) + p)
    return rng.integers(0, 7, size=(p, p)).tolist()


def main():
    comm = init(comm_timeout=30)
    mpi, p, r = comm.mpi_comm, comm.size, comm.rank
    cases = 0
    for case in ("zeros", "silent_rank", "empty", "random1", "random2"):
        table = send_table(case, p)
        sends, receives = table[r], [table[i][r] for i in range(p)]
        for row_shape, dtype in (((), np.float64), ((3,), np.int32), ((2, 2), np.float32), ((), np.int64)):
            width = int(np.prod(row_shape))
            x = (r * 1000 + np.arange(sum(sends) * width)).astype(dtype).reshape((sum(sends),) + row_shape)
            ref = np.empty((sum(receives),) + row_shape, dtype)
            counts_out, counts_in = [s * width for s in sends], [s * width for s in receives]
            mpi.Alltoallv([x, (counts_out, np.cumsum([0] + counts_out[:-1]).tolist())],
                          [ref, (counts_in, np.cumsum([0] + counts_in[:-1]).tolist())])
            for output_sizes, async_op, check in ((receives, False, True), (None, False, True),
                                                  (None, True, False), (receives, True, False)):
                comm.check_collectives = check
                got = all_to_all_single(comm, x, output_sizes, sends, async_op=async_op)
                got = got.wait() if async_op else got
                assert got.dtype == ref.dtype and got.shape == ref.shape and np.array_equal(got, ref), \
                    f"[rank {r}] {case} {row_shape} {np.dtype(dtype).name} differs from MPI_Alltoallv"
                cases += 1
    comm.check_collectives = True
    # split sizes that disagree: every rank raises the same error, no row has moved, the next call works
    table = send_table("zeros", p)
    sends, receives = table[r], [table[i][r] for i in range(p)]
    receives[0] += r == p - 1
    try:
        all_to_all_single(comm, np.zeros(sum(sends)), receives, sends)
        raise AssertionError(f"[rank {r}] disagreeing split sizes were not detected")
    except CollectiveMismatchError as e:
        assert f"rank 0 sends {table[0][p - 1]} rows to rank {p - 1}, which expects {table[0][p - 1] + 1}" in str(e), e
    receives[0] -= r == p - 1
    assert np.array_equal(all_to_all_single(comm, np.zeros(sum(sends)), receives, sends), np.zeros(sum(receives)))
    print(f"rank {r} of {p}: alltoallv {cases} cases agree", flush=True)


if __name__ == "__main__":
    main()

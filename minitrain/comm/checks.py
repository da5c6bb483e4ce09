"""Every collective checked exactly on awkward sizes and every dtype, on any communicator:
run in-process on ThreadWorld by the tests, and under mpiexec against MPI's built-ins
(python -m minitrain.comm.checks). The inputs and the NumPy oracle (rank_input,
expected_reduction, collective_lengths) are shared with the exercises' graders; they live here,
in comm, because comm must not import the layers above it (testing.py reaches autograd)."""
import sys

import numpy as np

from . import collectives as C
from . import rings as R
from .reductions import chunk_bounds

# Integer-valued floats make every order of additions exact, so results must agree bit for bit.
COLLECTIVE_DTYPES = ("float32", "float64", "int32", "int64", "float16")


def collective_lengths(p):
    """0, 1, fewer than p, not divisible by p, and a few thousand."""
    return sorted({0, 1, max(p - 1, 1), 7, 13 * p + 1, 4099})


def rank_input(rank, n, dtype, seed=0):
    """Rank ``rank``'s input: integers in [-50, 50) as ``dtype`` (every rank can rebuild everyone's)."""
    rng = np.random.default_rng([seed, rank, n])
    return rng.integers(-50, 50, n).astype(dtype)


def expected_reduction(p, n, dtype, op, seed=0):
    stack = np.stack([rank_input(r, n, dtype, seed) for r in range(p)]).astype(np.float64)
    result = {"sum": stack.sum, "mean": stack.mean, "max": stack.max, "min": stack.min, "prod": stack.prod}[op](0)
    return result.astype(dtype)


def exact_product(p, dtype):
    """Whether a product of p inputs (|x| <= 50) is exact in ``dtype`` in any order (every partial product
    representable), so that every algorithm's product agrees bit for bit."""
    dtype = np.dtype(dtype)
    digits = np.finfo(dtype).nmant + 1 if dtype.kind == "f" else np.iinfo(dtype).bits - 1
    return 50 ** p < 2 ** digits


def _mpi_reference(mpi_comm, x, op):
    """MPI's built-in Allreduce, for the dtypes and ops MPI has."""
    from mpi4py import MPI
    if x.dtype == np.float16 or op == "mean":
        return None
    out = np.empty_like(x)
    mpi_comm.Allreduce(x, out, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op])
    return out


def check_all_reduce(comm, impl, ops=("sum", "mean", "max", "min", "prod"), dtypes=COLLECTIVE_DTYPES,
                     lengths=None, mpi_comm=None, name="all_reduce"):
    """Run ``impl(comm, x, op=op)`` on every (length, dtype, op) and compare exactly with the
    NumPy oracle (and MPI_Allreduce when ``mpi_comm`` is given). Returns the number of checks."""
    count = 0
    for n in lengths or collective_lengths(comm.size):
        for dtype in dtypes:
            for op in ops:
                if op == "mean" and np.dtype(dtype).kind != "f" or op == "prod" and not exact_product(comm.size, dtype):
                    continue
                x = rank_input(comm.rank, n, dtype)
                before = x.copy()
                got = impl(comm, x, op=op)
                want = expected_reduction(comm.size, n, dtype, op)
                where = f"[rank {comm.rank}] {name} p={comm.size} n={n} {dtype} op={op}"
                assert np.array_equal(x, before), f"{where}: the input was modified"
                assert got.dtype == x.dtype and got.shape == x.shape, f"{where}: got {got.dtype}{got.shape}"
                assert np.array_equal(got, want), f"{where}: wrong result {got[:8]} vs {want[:8]}"
                if mpi_comm is not None:
                    ref = _mpi_reference(mpi_comm, x, op)
                    if ref is not None:
                        assert np.array_equal(got, ref), f"{where}: differs from MPI_Allreduce"
                count += 1
    return count


def check_reduce_scatter(comm, mpi_comm=None):
    count = 0
    for n in collective_lengths(comm.size):
        for dtype in COLLECTIVE_DTYPES:
            for op in ("sum", "max", "min", "prod"):
                if op == "prod" and not exact_product(comm.size, dtype):
                    continue
                x = rank_input(comm.rank, n, dtype)
                got = R.ring_reduce_scatter(comm, x, op=op)
                want = np.array_split(expected_reduction(comm.size, n, dtype, op), comm.size)[comm.rank]
                assert np.array_equal(got, want), f"[rank {comm.rank}] reduce_scatter n={n} {dtype} {op}"
                if mpi_comm is not None and dtype != "float16":
                    from mpi4py import MPI
                    counts = [b - a for a, b in zip(chunk_bounds(n, comm.size)[:-1], chunk_bounds(n, comm.size)[1:])]
                    ref = np.empty(counts[comm.rank], dtype)
                    mpi_comm.Reduce_scatter(x, ref, counts, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
                                                                "prod": MPI.PROD}[op])
                    assert np.array_equal(got, ref), f"[rank {comm.rank}] reduce_scatter differs from MPI"
                count += 1
    return count


def check_all_gather(comm, mpi_comm=None):
    count = 0
    for n in collective_lengths(comm.size):
        for dtype in COLLECTIVE_DTYPES:
            full = rank_input(99, n, dtype)
            shard = np.array_split(full, comm.size)[comm.rank]
            for total in (n, None):
                got = R.ring_all_gather(comm, shard, total=total)
                assert np.array_equal(got, full), f"[rank {comm.rank}] all_gather n={n} {dtype} total={total}"
                count += 1
            if mpi_comm is not None and dtype != "float16":
                counts = [len(s) for s in np.array_split(full, comm.size)]
                ref = np.empty(n, dtype)
                mpi_comm.Allgatherv(shard, [ref, counts])
                assert np.array_equal(ref, got), f"[rank {comm.rank}] all_gather differs from MPI"
    return count


def check_trees(comm, mpi_comm=None):
    count = 0
    for n in collective_lengths(comm.size):
        for dtype in COLLECTIVE_DTYPES:
            for root in sorted({0, comm.size - 1}):
                buf = rank_input(comm.rank, n, dtype)
                C.broadcast(comm, buf, root=root)
                assert np.array_equal(buf, rank_input(root, n, dtype)), f"[rank {comm.rank}] broadcast root={root}"
                got = C.reduce(comm, rank_input(comm.rank, n, dtype), root=root, op="sum")
                if comm.rank == root:
                    assert np.array_equal(got, expected_reduction(comm.size, n, dtype, "sum")), "reduce"
                else:
                    assert got is None
                count += 2
        if mpi_comm is not None:
            x = rank_input(comm.rank, n, np.float64)
            ref = x.copy()
            mpi_comm.Bcast(ref, root=0)
            C.broadcast(comm, x, root=0)
            assert np.array_equal(x, ref), "broadcast differs from MPI_Bcast"
    return count


def check_all_to_all(comm, mpi_comm=None):
    count = 0
    for per_block in (0, 1, 3):
        for dtype in COLLECTIVE_DTYPES:
            x = rank_input(comm.rank, comm.size * per_block * 2, dtype).reshape(comm.size * per_block, 2)
            got = C.all_to_all(comm, x)
            blocks = [np.split(rank_input(r, comm.size * per_block * 2, dtype).reshape(-1, 2), comm.size)[comm.rank]
                      for r in range(comm.size)]
            assert np.array_equal(got, np.concatenate(blocks)), f"[rank {comm.rank}] all_to_all"
            if mpi_comm is not None and dtype != "float16":
                ref = np.empty_like(x)
                mpi_comm.Alltoall(x, ref)
                assert np.array_equal(got, ref), "all_to_all differs from MPI_Alltoall"
            count += 1
    return count


def run_all(comm, mpi_comm=None):
    """Every collective on every case; returns {name: number of checks}."""
    counts = {}
    for name in ("ring_all_reduce", "recursive_doubling_all_reduce", "naive_all_reduce", "all_reduce"):
        impl = getattr(C, name)
        counts[name] = check_all_reduce(comm, impl, mpi_comm=mpi_comm, name=name)
    counts["ring_reduce_scatter"] = check_reduce_scatter(comm, mpi_comm)
    counts["ring_all_gather"] = check_all_gather(comm, mpi_comm)
    counts["broadcast+reduce"] = check_trees(comm, mpi_comm)
    counts["all_to_all"] = check_all_to_all(comm, mpi_comm)
    return counts


def main():
    from .mpi import init
    comm = init(comm_timeout=60)
    big = "--big" in sys.argv
    counts = run_all(comm, mpi_comm=comm.mpi_comm)
    if big:   # 2^27 + 3 elements, not divisible by p
        n, period = (1 << 27) + 3, 251
        # a different small integer at every position and rank, i % 251 + 7·rank, so that a chunk sent to the
        # wrong place, or summed twice, changes the result; in the narrowest integer that holds the sum (int16,
        # 256 MiB a rank at p = 4: the length is what is checked here, and half float32's bytes halve its time)
        top = (period - 1) * comm.size + 7 * sum(range(comm.size))
        dtype = np.int16 if top < 2 ** 15 else np.int32
        x = np.resize(np.arange(period, dtype=dtype) + 7 * comm.rank, n)
        got = R.ring_all_reduce(comm, x)
        ref = np.empty_like(x)
        comm.mpi_comm.Allreduce(x, ref)
        assert np.array_equal(got, ref), f"[rank {comm.rank}] 2^27 + 3 elements differ from MPI"
        del x, ref
        want = (np.arange(period) * comm.size + 7 * sum(range(comm.size))).astype(dtype)   # the formula
        whole = n // period * period
        rows = got[:whole].reshape(-1, period)
        for lo in range(0, len(rows), 1 << 16):            # a block of rows at a time (memory)
            wrong = f"[rank {comm.rank}] 2^27 + 3 elements: wrong at {lo * period}+"
            assert (rows[lo:lo + (1 << 16)] == want).all(), wrong
        assert np.array_equal(got[whole:], want[:n - whole]), f"[rank {comm.rank}] 2^27 + 3 elements: wrong at the end"
        counts["ring_all_reduce 2^27+3"] = 1
    print(f"rank {comm.rank} of {comm.size}: {sum(counts.values())} checks passed {counts}", flush=True)


if __name__ == "__main__":
    main()

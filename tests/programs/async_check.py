"""Asynchronous all-reduces against MPI_Allreduce (run by tests/test_comm_async.py under mpiexec at
p = 2 and 4): each size and dtype by the steal path (waited on at once: the waiting thread runs it)
and by the progress path (the progress thread started it; waited on once it is done), and several
queued at once, waited on last first. Integer-valued data, so every summation order is exact.
Every rank prints ``rank r of p: async ok (N cases)``."""
import time

import numpy as np

from minitrain.comm import all_reduce, init, work


def main():
    comm = init(comm_timeout=30)
    mpi, p, r = comm.mpi_comm, comm.size, comm.rank
    rng = np.random.default_rng(r)
    cases = 0
    for delay, path in ((3600.0, "steal"), (0.0, "progress")):
        work.START_DELAY_S = delay
        xs = [rng.integers(-1000, 1000, n).astype(dtype)
              for n in (1, 1000, (1 << 16) + 3) for dtype in (np.float64, np.float32, np.int64)]
        works = [all_reduce(comm, x, async_op=True) for x in xs]
        if path == "progress":
            deadline = time.monotonic() + 60
            while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
                time.sleep(1e-3)
            assert all(w.is_completed() for w in works), f"[rank {r}] the progress thread did not run them"
        for x, w in reversed(list(zip(xs, works))):            # the last first
            ref = np.empty_like(x)
            mpi.Allreduce(x, ref)
            got = w.wait()
            assert got.dtype == x.dtype and np.array_equal(got, ref), f"[rank {r}] {path} {x.dtype} {x.size}"
            cases += 1
        out = np.empty_like(xs[4])
        assert all_reduce(comm, xs[4], out=out, async_op=True).wait() is out
    print(f"rank {r} of {p}: async ok ({cases} cases)", flush=True)


if __name__ == "__main__":
    main()

"""Injected faults under real MPI (run by tests/test_mpi_comm.py through mpiexec).
usage: comm_faults.py {skip,shape,raise,sleep,async,ok}"""
import sys
import time

import numpy as np

from minitrain.comm import all_reduce, init, ring_all_reduce

fault = sys.argv[1]
comm = init()
x = np.ones(1000, np.float32)
print(f"rank {comm.rank} ready", flush=True)
if fault == "skip" and comm.rank == 1:
    pass                                         # rank 1 never calls the collective
elif fault == "shape" and comm.rank == comm.size - 1:
    ring_all_reduce(comm, np.ones(1001, np.float32))
elif fault == "raise" and comm.rank == 1:
    raise ValueError("injected failure before the collective")
elif fault == "sleep" and comm.rank == 1:
    time.sleep(30)
    ring_all_reduce(comm, x)
elif fault == "async":
    works = [all_reduce(comm, x * (i + 1), async_op=True) for i in range(5)]
    middle = ring_all_reduce(comm, x)            # a blocking collective while async ones are in flight
    results = [w.wait() for w in works]
    assert all(np.all(r == comm.size * (i + 1)) for i, r in enumerate(results)), "async results"
    assert np.all(middle == comm.size)
else:
    ring_all_reduce(comm, x)
comm.barrier()
print(f"rank {comm.rank} done", flush=True)

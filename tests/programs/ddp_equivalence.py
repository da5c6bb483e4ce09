"""DDP vs single-process training under real MPI (run by tests/test_ddp_mpi.py): the same harness
as the ThreadWorld tests in tests/test_ddp.py, on MPICommunicator."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
from test_ddp import ADAM, SGD, run_equivalence  # noqa: E402

from minitrain.comm import init  # noqa: E402

comm = init(timeout=60)
for cap_mb in (25.0, 0.001, 0.0):
    buckets, sent, _ = run_equivalence(comm, cap_mb, SGD)
    print(f"rank {comm.rank}: cap {cap_mb} MiB, {buckets} buckets, {sent} bytes/step: equal", flush=True)
run_equivalence(comm, 0.001, ADAM, 2, 3)            # no_sync accumulation over 3 micro-batches
run_equivalence(comm, 0.0, ADAM, 3, 1, True, (1,))   # unused parameters
print(f"rank {comm.rank}: no_sync and unused parameters: equal", flush=True)

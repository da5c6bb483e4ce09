"""Pipeline schedules vs single-process training under real MPI (run by tests/test_pipeline_mpi.py):
the harness of tests/test_pipeline.py on MPICommunicator."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
from test_pipeline import assert_equal_to_reference, make_model, pipeline_run, reference_run  # noqa: E402

from minitrain.comm import init  # noqa: E402

comm = init(timeout=60)
p = comm.size
reference, losses = reference_run()
init_state = make_model().state_dict()
for schedule in ("gpipe", "1f1b", "naive", "zb_h1"):
    for m in (1, p, 2 * p):
        assert_equal_to_reference([pipeline_run(comm, init_state, schedule, m)], reference, losses)
        print(f"rank {comm.rank}: {schedule} m={m}: equal", flush=True)
depth = 2 * p
reference, losses = reference_run(depth=depth)
assert_equal_to_reference([pipeline_run(comm, make_model(depth).state_dict(), "interleaved_1f1b", 2 * p, 2,
                                        depth=depth)], reference, losses)
print(f"rank {comm.rank}: interleaved_1f1b: equal", flush=True)
assert_equal_to_reference([pipeline_run(comm, make_model(depth).state_dict(), "zbv", 2 * p, None, depth=depth)],
                          reference, losses)
print(f"rank {comm.rank}: zbv: equal", flush=True)
if p % 2 == 0:
    reference, _ = reference_run()
    assert_equal_to_reference([pipeline_run(comm, init_state, "1f1b", 3, dp=2)], reference)
    print(f"rank {comm.rank}: dp=2 x pp={p // 2}: equal", flush=True)

"""The communication layer under real mpiexec: exact agreement with MPI's built-ins at p = 1..4
(the injected faults: tests/test_faults.py)."""
import re
import sys

import pytest

from minitrain.testing import run_mpi


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_collective_matches_mpi_builtins(p):
    result = run_mpi([sys.executable, "-m", "minitrain.comm.checks"], n=p, timeout=180)
    for r in range(p):
        assert f"rank {r} of {p}:" in result.stdout and "checks passed" in result.stdout


@pytest.mark.slow
def test_ring_all_reduce_of_2_to_the_27_elements_matches_mpi():
    result = run_mpi([sys.executable, "-m", "minitrain.comm.checks", "--big"], n=4, timeout=300)
    for r in range(4):      # each rank checked 2^27 + 3 varied elements against MPI_Allreduce and the formula
        assert re.search(rf"rank {r} of 4: \d+ checks passed .*'ring_all_reduce 2\^27\+3': 1", result.stdout), result.stdout


def test_init_refuses_a_timeout_that_is_not_positive_before_its_start_up_waits_with_it():
    """comm.init(comm_timeout=-1) was read as a start-up that had already run out (a CollectiveTimeout blaming
    the ranks); it is the argument's ValueError, on every rank."""
    code = ("from minitrain import comm\n"
            "for kwargs in ({'comm_timeout': -1}, {'timeout': -2}):\n"
            "    try:\n"
            "        comm.init(**kwargs)\n"
            "    except ValueError as e:\n"
            "        print('refused:', e, flush=True)\n")
    out = run_mpi([sys.executable, "-c", code], n=2, timeout=60).stdout
    for rank in (0, 1):
        assert f"[{rank}] refused: comm_timeout must be a positive number of seconds, got -1" in out, out
        assert f"[{rank}] refused: timeout must be a positive number of seconds, got -2" in out, out

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

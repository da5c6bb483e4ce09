"""DDP equals single-process training under real mpiexec too, at p = 2, 3, 4."""
import pathlib
import sys

import pytest

from minitrain.testing import run_mpi

PROGRAM = str(pathlib.Path(__file__).parent / "programs" / "ddp_equivalence.py")


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ddp_equals_single_process_under_mpi(p):
    result = run_mpi([sys.executable, PROGRAM], n=p, timeout=120)
    for r in range(p):
        assert f"rank {r}: no_sync and unused parameters: equal" in result.stdout

"""The pipeline runtime equals single-process training under real mpiexec too."""
import pathlib
import sys

import pytest

from minitrain.testing import run_mpi

PROGRAM = str(pathlib.Path(__file__).parent / "programs" / "pipeline_equivalence.py")


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_equals_single_process_under_mpi(p):
    result = run_mpi([sys.executable, PROGRAM], n=p, timeout=180)
    for r in range(p):
        assert f"rank {r}: interleaved_1f1b: equal" in result.stdout
        assert f"rank {r}: 1f1b m={2 * p}: equal" in result.stdout
        assert f"rank {r}: zb_h1 m={2 * p}: equal" in result.stdout and f"rank {r}: zbv: equal" in result.stdout
        if p % 2 == 0:
            assert f"rank {r}: dp=2 x pp={p // 2}: equal" in result.stdout

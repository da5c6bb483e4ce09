"""run_mpi, the harness every later MPI test uses: rank-labelled output, failures and hangs
reported with every rank's output, within the timeout."""
import sys
import time

import pytest

from minitrain.testing import MPIRunError, run_mpi


def test_every_rank_runs_and_is_labelled():
    result = run_mpi([sys.executable, "-c", "import os; print('hello from', os.environ['PMI_RANK'])"], n=3, timeout=30)
    for r in range(3):
        assert f"[{r}] hello from {r}" in result.stdout


def test_a_failing_rank_fails_the_run_with_all_output():
    code = "import os, sys; r = int(os.environ['PMI_RANK']); print('rank', r, 'ok'); sys.exit(3 if r == 1 else 0)"
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-c", code], n=2, timeout=30)
    assert "rank 0 ok" in str(err.value) and "rank 1 ok" in str(err.value)


def test_a_hanging_rank_is_killed_at_the_timeout():
    code = ("import os, time; r = int(os.environ['PMI_RANK']); print('rank', r, 'started', flush=True);"
            "time.sleep(600 if r == 1 else 0)")
    start = time.monotonic()
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-c", code], n=2, timeout=5)
    assert time.monotonic() - start < 30
    assert "rank 1 started" in str(err.value)


def test_open_mpis_launcher_gets_its_own_flags(tmp_path, monkeypatch):
    import os
    from minitrain import backend
    from minitrain.testing import launcher_args
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.6'\n")
    fake.chmod(0o755)
    args = launcher_args(str(fake), 4, label=True)
    assert args[:2] == ["-n", "4"] and "--tag-output" in args and "--oversubscribe" in args
    assert ("--allow-run-as-root" in args) == (os.geteuid() == 0)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    monkeypatch.delenv("MPI_LOCALRANKID", raising=False)
    assert backend.local_rank() == 3                      # Open MPI's local rank places the GPU


def test_mpichs_launcher_labels_with_l():
    from minitrain.testing import launcher_args, mpiexec_path
    assert launcher_args(mpiexec_path(), 2, label=True) == ["-n", "2", "-l"]

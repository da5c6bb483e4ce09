"""run_mpi, the harness every later MPI test uses: rank-labelled output, failures and hangs
reported with every rank's output, within the timeout."""
import os
import sys

import pytest

from minitrain.testing import MPIRunError, _normalise_labels, mpiexec_command, run_mpi

RANK = "int(os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK'])"   # MPICH or Open MPI


def test_every_rank_runs_and_is_labelled():
    result = run_mpi([sys.executable, "-c", f"import os; print('hello from', {RANK})"], n=3, timeout=30)
    for r in range(3):
        assert f"[{r}] hello from {r}" in result.stdout


def test_a_failing_rank_fails_the_run_with_all_output():
    code = f"import os, sys; r = {RANK}; print('rank', r, 'ok'); sys.exit(3 if r == 1 else 0)"
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-c", code], n=2, timeout=30)
    assert "rank 0 ok" in str(err.value) and "rank 1 ok" in str(err.value)


def test_a_hanging_rank_is_killed_at_the_timeout():
    code = (f"import os, time; r = {RANK}; print('rank', r, 'started', flush=True);"
            "time.sleep(600 if r == 1 else 0)")
    with pytest.raises(MPIRunError) as err:          # a kill that failed would hang here (pytest's timeout)
        run_mpi([sys.executable, "-c", code], n=2, timeout=5)
    assert "rank 1 started" in str(err.value)


def test_open_mpi_output_is_labelled_like_mpich_and_its_launch_has_the_flags_it_needs(monkeypatch):
    import minitrain.testing as testing
    assert _normalise_labels("[1,0]<stdout>:hello\n[1,3]<stderr>: oops\n") == "[0] hello\n[3] oops\n"
    monkeypatch.setattr(testing, "_LAUNCHER", ("/usr/bin/mpirun", "openmpi"))
    cmd = mpiexec_command(4, label=True)
    assert cmd[:3] == ["/usr/bin/mpirun", "-n", "4"] and "--oversubscribe" in cmd and "--tag-output" in cmd
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    monkeypatch.setattr(testing, "_LAUNCHER", ("/venv/bin/mpiexec", "mpich"))
    assert mpiexec_command(2, label=True) == ["/venv/bin/mpiexec", "-n", "2", "-l"]


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


def test_a_benchmark_worker_that_fails_after_writing_its_file_leaves_no_file_behind(tmp_path, monkeypatch):
    """run_worker removes the worker's JSON whether or not the worker exits cleanly."""
    import subprocess
    import tempfile
    from minitrain import testing
    script = tmp_path / "worker.py"
    script.write_text("import sys\nopen(sys.argv[2], 'w').write('{}')\nsys.exit(1)\n")
    monkeypatch.setattr(testing, "mpiexec_command", lambda n: [])        # the worker alone, as rank 0
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(subprocess.CalledProcessError):
        testing.run_worker(script, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["worker.py"]

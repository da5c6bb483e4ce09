"""The six faults of issue 15 injected under ``mpiexec -n 4`` (tests/programs/comm_faults.py, written
against the public API), each with default settings unless stated: one rank skips a collective,
calls a different one, passes a different shape, raises, is killed with SIGKILL, or sleeps past
``--comm-timeout 2``. Each must end the whole job with a non-zero status, with output that names the faulty
rank (1) and the call; those a check catches end at once, without waiting for a stall report (none is printed),
the sleeping rank at the hard timeout (the job's own report says how long it waited). Also: a launcher of one
MPI with the library of another stops at once, naming both."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from minitrain.testing import mpi_launcher, run_mpi, run_together

FAULTS = str(pathlib.Path(__file__).parent / "programs" / "comm_faults.py")
STALLED = "has waited"          # the stall report's words: a call waited past --comm-timeout


def job(fault, *flags, status=None):
    """Run the fault job; its output. ``status``: the exit status the launcher must return (default: any but 0).
    A job that never ended would fail here at run_mpi's timeout (90 s)."""
    result = run_mpi([sys.executable, FAULTS, fault, *flags], n=4, timeout=90, check=False)
    out = result.stdout
    assert result.returncode != 0, f"{fault}: the job exited 0\n{out}"
    assert status is None or result.returncode == status, f"{fault}: the job exited {result.returncode}\n{out}"
    assert re.search(r"rank 1 injects \w+ at ([\d.]+)", out), f"{fault}: the fault was never injected\n{out}"
    return out


# The jobs that wait out a stall threshold or a timeout (2-6 s asleep each) run at once, before the tests
# that read them: what they assert are lower bounds on the waits and what the reports name, which a job
# beside them changes no more than the busy machine the suite must pass on.
WAITING = {
    "test_a_rank_that_skips_the_last_collective_and_leaves_is_named":
        lambda: job("skip_last", "--comm-timeout", "3", status=1),       # the default 10 s works alike, slower
    "test_a_rank_that_calls_a_different_collective_is_named_by_the_flight_recorder_without_checks":
        lambda: job("other", "--no-check", "--comm-timeout", "2"),
    "test_a_rank_that_sleeps_past_the_comm_timeout_is_named_and_the_job_ends_at_the_hard_timeout":
        lambda: job("sleep", "--comm-timeout", "2"),
    "test_the_receive_contract_holds_under_mpi_too":
        lambda: run_mpi([sys.executable, str(pathlib.Path(__file__).parent / "programs" / "recv_contract.py")], n=2,
                        timeout=60).stdout,
}


@pytest.fixture(scope="module")
def waited(request):
    """The selected WAITING jobs, run together: test name -> (output, None) or (None, the exception)."""
    names = [item.originalname for item in request.session.items if getattr(item, "originalname", None) in WAITING]
    return run_together({name: WAITING[name] for name in names}, workers=len(WAITING))


@pytest.fixture
def waited_output(request, waited):
    """This test's WAITING job's output (its failure raised here)."""
    out, error = waited[request.node.originalname]
    if error is not None:
        raise error
    return out


def test_a_rank_that_skips_a_collective_is_named_at_its_next_call():
    out = job("skip")
    assert re.search(r"rank 1: broadcast #\d+ shape=\(1,\) int64 8 B root=0   <-- differs", out), out
    assert re.search(r"rank\(s\) \[0, 2, 3\] called recursive_doubling_all_reduce #\d+ shape=\(1000,\)", out), out
    assert STALLED not in out, out


def test_a_rank_that_skips_the_last_collective_and_leaves_is_named(waited_output):
    """The reporting rank's MPI_Abort(1) ends the job: rank 1, which has left the script, waits for it
    instead of exiting 0 first (that raced the abort: the launcher tore the job down with the reporter
    still in its grace sleep, and under load returned 0 for it)."""
    out = waited_output
    assert "rank 1: has left the script" in out and "rank(s) [1] have left the script and will never call" in out, out


def test_a_rank_that_calls_a_different_collective_is_named():
    out = job("other")
    assert re.search(r"rank 1: broadcast #\d+ shape=\(1000,\) float32 3.9 KiB root=0   <-- differs", out), out
    assert STALLED not in out, out


def test_a_rank_that_calls_a_different_collective_is_named_by_the_flight_recorder_without_checks(waited_output):
    out = waited_output
    assert re.search(r"rank 1: in broadcast #\d+ shape=\(1000,\) float32 .*<-- differs", out), out
    assert "flight recorder report" in out and re.search(r"rank\(s\) \[1\] called broadcast #\d+", out), out


def test_a_rank_with_a_different_shape_is_named():
    out = job("shape")
    assert re.search(r"rank 1: recursive_doubling_all_reduce #\d+ shape=\(1001,\) float32 3.9 KiB op=sum   <-- differs", out), out
    assert STALLED not in out, out


def test_a_different_shape_without_checks_fails_on_the_first_message_naming_both_sizes():
    out = job("shape", "--no-check")
    assert re.search(r"the message from rank 1 has (more than the 4000 bytes|\d+ bytes)", out) or \
        re.search(r"the message from rank \d has 4000 bytes, but rank 1 expected 4004 bytes", out), out
    assert "shape=(1001,)" in out and STALLED not in out, out


def test_a_ddp_replica_of_another_shape_is_named():
    out = job("ddp_shape")
    assert re.search(r"rank 1: broadcast #\d+ shape=\(3, 5\) float32 60 B root=0   <-- differs", out), out
    assert STALLED not in out, out


def test_a_rank_that_raises_aborts_the_job_with_its_traceback_and_last_calls():
    out = job("raise")
    assert "[rank 1] ValueError: injected failure in step 2" in out, out
    assert "[rank 1] flight recorder (this rank's last calls, newest last):" in out and STALLED not in out, out


def test_a_rank_killed_by_sigkill_is_named_with_the_call_it_was_in():
    out = job("kill")
    if mpi_launcher()[1] == "mpich":      # Open MPI's mpirun names the rank itself ("exited on signal 9")
        assert re.search(r"rank 1 \(pid \d+\) ended without leaving Python: killed by a signal", out), out
        assert re.search(r"it was (computing: its last call, broadcast #\d+|in \w+ #\d+)", out), out
    else:
        assert re.search(r"rank 1 .*(exited on signal 9|ended without leaving Python)", out), out
    assert STALLED not in out, out


def test_a_rank_that_sleeps_past_the_comm_timeout_is_named_and_the_job_ends_at_the_hard_timeout(waited_output):
    out = waited_output
    assert "warning: flight recorder report" in out and "Still waiting, up to the hard timeout (6 s)" in out, out
    assert "rank 1: computing: no call in progress" in out and "Ending the job (hard timeout)" in out, out
    waited = [float(s) for s in re.findall(r"recursive_doubling_all_reduce #\d+ has waited ([\d.]+) s", out)]
    assert out.count("warning: flight recorder report") == 1 and len(waited) == 2 and waited[1] >= 6, out


def test_asynchronous_collectives_in_flight_beside_a_blocking_one_finish():
    result = run_mpi([sys.executable, FAULTS, "async"], n=4, timeout=60)
    assert result.stdout.count("done") == 4


def test_a_launcher_of_another_mpi_stops_the_job_naming_both():
    # the launcher's size variable of the *other* MPI: its job, seen by this library, is a world of one
    size_var, rank_var = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK") if mpi_launcher()[1] == "mpich"
                          else ("PMI_SIZE", "PMI_RANK"))
    code = "from minitrain.comm import init; init(); print('trained alone')"
    for rank in (0, 1):
        env = {**os.environ, size_var: "2", rank_var: str(rank)}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and "trained alone" not in result.stdout
        if rank == 0:
            from minitrain.comm import mpi_library
            text = result.stderr
            assert f"{size_var}=2" in text and "COMM_WORLD has 1 rank" in text, text
            assert mpi_library() in text and "Launch with the mpiexec of that MPI" in text, text
            assert mpi_launcher()[0] in text, text
        else:
            assert "minitrain:" not in result.stderr                 # printed once, by rank 0


def test_the_receive_contract_holds_under_mpi_too(waited_output):
    """MPI accepts a shorter message and garbles another dtype; minitrain refuses both, as ThreadWorld does.
    Also: a second init() starts no second death watch; a rank waits at exit for the others 3 s at most."""
    out = waited_output
    cases = dict(re.findall(r"CASE (\w+)[^:]*: (.*)", out))
    assert set(cases) == {"shorter", "longer", "dtype"}, out
    assert re.search(r"\[rank 1\] recv from rank 0 \(tag 5\): the message from rank 0 has 24 bytes, but rank 1 "
                     r"expected 32 bytes \(float64, shape \(4,\)\); rank 0 sent float64 of shape \(3,\)", cases["shorter"])
    assert "(tag 6): the message from rank 0 has more than the 32 bytes that fit" in cases["longer"], cases
    assert re.search(r"rank 0 sends float32 .*\(16 bytes\) with tag 7, rank 1 recvs float64 .*\(16 bytes\)",
                     cases["dtype"]) or re.search(r"rank 1 recvs float64 .* with tag 7, rank 0 sends float32",
                                                  cases["dtype"]), cases["dtype"]
    assert "rank 0 done" in out and "rank 1 done" in out and "pending" not in out, out   # withdrawn: no request left
    if hasattr(os, "pidfd_open"):
        assert "death watchers of rank 0: 1" in out, out
    assert "[rank 0] left the script 3 s ago; rank(s) [1] have not: not waiting for them any longer" in out, out


def test_the_death_watch_names_first_the_rank_the_others_waited_for():
    # under load the launcher's kill of rank 2 (waiting in call #4) can be seen before the death of
    # rank 1 (computing after call #3), which the others were waiting for: rank 1 must be named first
    from minitrain.comm import death_watch
    slots = {0: {"in_call": True, "seq": 4, "name": "all_reduce", "comm": "world", "t_start": 0.0, "t_end": 0.0},
             1: {"in_call": False, "seq": 3, "name": "broadcast", "comm": "world", "t_start": 0.0, "t_end": 0.0},
             2: {"in_call": True, "seq": 4, "name": "all_reduce", "comm": "world", "t_start": 0.0, "t_end": 0.0}}
    dead = death_watch._first_first([(2, 102, 2), (1, 101, 1)], slots)
    assert [d[0] for d in dead] == [1, 2]
    # equal evidence keeps the order the deaths were seen in
    assert [d[0] for d in death_watch._first_first([(2, 102, 2), (0, 100, 0)], slots)] == [2, 0]

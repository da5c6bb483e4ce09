"""The pipeline's progress thread (minitrain/parallel/pipeline/progress.py): MPI is asked whether a large
message moves while its sender stays out of MPI, and where it does not, a thread moves the messages while
the rank computes. MPICH's single copy (CMA) on and off stands for the two kinds of MPI (Open MPI without
CMA: btl_vader_single_copy_mechanism=none, set here too)."""
import gc
import pathlib
import re
import sys
import time

import pytest

from minitrain.comm import ThreadWorld
from minitrain.parallel.pipeline.progress import ENV, ComputeProgress, asked
from minitrain.testing import run_mpi

PROGRAM = str(pathlib.Path(__file__).parent / "programs" / "pipeline_progress.py")
EQUIVALENCE = str(pathlib.Path(__file__).parent / "programs" / "pipeline_equivalence.py")
SINGLE_COPY = {True: {"MPIR_CVAR_CH4_CMA_ENABLE": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "cma"},
               False: {"MPIR_CVAR_CH4_CMA_ENABLE": "0", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}}


def run(single_copy, thread):
    out = run_mpi([sys.executable, PROGRAM, "thread" if thread else "none"], n=2, timeout=120,
                  env={**SINGLE_COPY[single_copy], ENV: ""}).stdout
    steps = {int(r): (loss, grads, int(polls)) for r, loss, grads, polls in
             re.findall(r"rank (\d): step loss (\S+) grads (\S+) polls (\d+)", out)}
    return out, steps


@pytest.mark.parametrize("single_copy", [True, False])
def test_mpi_is_asked_whether_a_message_moves_without_its_sender(single_copy):
    out, _ = run(single_copy, thread=False)
    for r in (0, 1):
        assert f"rank {r}: moves without its sender {single_copy}, thread {not single_copy}" in out, out


def test_without_single_copy_the_thread_moves_a_message_while_its_sender_computes():
    out, with_thread = run(False, thread=True)
    assert "rank 1: arrived during the sender's compute" in out, out
    polls = {int(r): int(n) for r, n in re.findall(r"rank (\d): polls in 9 steps (\d+)", out)}
    assert polls[0] > 0, out                           # rank 0 computed with its sends in flight
    for r in (0, 1):                                   # a process that builds many pipelines keeps no threads
        assert f"rank {r}: thread ended with its pipeline True" in out, out
    out, without = run(False, thread=False)
    assert "rank 1: arrived after the sender's compute" in out, out      # what the thread is for
    assert without[0][2] == 0 and without[1][2] == 0
    for r in (0, 1):                                   # the same step, to the last bit
        assert with_thread[r][:2] == without[r][:2]


def test_a_pipeline_with_its_progress_thread_equals_single_process():
    out = run_mpi([sys.executable, EQUIVALENCE], n=2, timeout=180, env={**SINGLE_COPY[False], ENV: "1"}).stdout
    for r in (0, 1):
        assert f"rank {r}: 1f1b m=4: equal" in out and f"rank {r}: zbv: equal" in out
        assert f"rank {r}: dp=2 x pp=1: equal" in out


def test_the_thread_is_asked_for_by_argument_or_environment():
    assert asked(True) is True and asked(False) is False
    assert asked(None, {}) is None and asked(None, {ENV: "auto"}) is None
    assert asked(None, {ENV: "1"}) is True and asked(None, {ENV: " 0 "}) is False
    assert asked(False, {ENV: "1"}) is False            # the argument wins
    with pytest.raises(ValueError, match=f"{ENV} must be auto, 1 or 0, got 'yes'"):
        asked(None, {ENV: "yes"})
    with pytest.raises(ValueError, match="progress_thread must be True, False or None"):
        asked("1")


class Messages:
    def __init__(self, sends, moving=False):
        self.moving, self.still_moving = sends, moving

    def move_sends(self):
        return self.still_moving


def test_threads_of_one_process_are_not_asked_and_the_thread_runs_only_with_sends_in_flight(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    world = ThreadWorld(2)
    progress = ComputeProgress(world.comms[0])
    assert (progress.enabled, progress.probed) == (False, None) and "no MPI" in progress.why

    def compute(action, received):
        return action, received

    assert progress.around(compute, Messages([object()])) is compute     # not enabled: the compute itself
    forced = ComputeProgress(world.comms[0], progress_thread=True)
    seen = []

    def watched(action, received):
        seen.append(forced._computing)
        return action, received

    assert forced.around(watched, Messages([object()]))("F", 1) == ("F", 1)
    assert forced.around(watched, Messages([]))("B", 2) == ("B", 2)
    assert seen == [True, False] and not forced._computing


def test_the_thread_ends_when_its_compute_progress_is_collected():
    world = ThreadWorld(2)
    progress = ComputeProgress(world.comms[0], progress_thread=True)
    thread = progress.thread
    assert thread.is_alive()
    progress.around(lambda action, received: time.sleep(0.05), Messages([object()], moving=True))("F", None)
    assert progress.polls > 0                          # the thread held the object while it tested
    del progress
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert ComputeProgress(world.comms[0], progress_thread=False).thread is None

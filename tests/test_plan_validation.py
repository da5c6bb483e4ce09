"""The planner against the jobs (minitrain/plan/validate.py): 14 runs of examples.mlp / examples.gpt under
mpiexec at 1-8 ranks (DDP, ZeRO-1/2/3, offload, fp16, GPipe, 1F1B, ZB-V, interleaved, TP, TP+SP, 3D,
recomputation). Memory: every rank's ledger peak, every category, within 5% of the prediction. Step time:
on a shared 2-core machine the wall clock of a step scatters by 10x (other jobs hold the cores), so each
run is compared by the median CPU time of its steps' own thread, which they inflate far less, and the
ratios of the runs whose ranks fit the cores are checked against their median (README: the figures)."""
import os
import statistics

import pytest

from minitrain.plan import validate


@pytest.fixture(scope="module")
def results():
    return [validate.run(name, timeout=240) for name in validate.RUNS]


@pytest.mark.slow
def test_the_runs_cover_every_strategy_at_1_to_8_ranks(results):
    described = " | ".join(f"{r['options']} {r['describe']}" for r in results)
    for feature in ("zero1", "zero2", "zero3", "offload", "fp16", "gpipe", "1f1b", "zbv", "interleaved", "tp2",
                    "sequence-parallel", "recompute full", "recompute selective", "dp2 pp2 tp2"):
        assert feature in described, feature
    assert {r["world"] for r in results} == {1, 2, 4, 8}
    assert all(r["job_printed_the_plan"] for r in results)           # the job's table shows the prediction


@pytest.mark.slow
def test_peak_memory_of_every_rank_is_the_ledgers_within_5_percent(results):
    for res in results:
        assert validate.memory_error(res) <= 0.05, (res["name"], res["ranks"])


@pytest.mark.slow
def test_step_time_where_ranks_fit_the_cores(results):
    """Other jobs on the machine inflate every run (even its CPU time, by evicting its caches: 2-3x at a load
    of 12 on 2 cores). So each run's predicted / measured ratio is compared with the median ratio of the
    runs, and that median with 1, both within 3x: no factor lost, no run out of line. The 1-rank run is left
    out of the time check: a job of one rank gives BLAS both cores, and whenever anything else runs its
    second thread waits for one (measured: 100x slower), which no prediction of the layout can know. The
    README's table has the figures; the unit tests check the model's parts (FLOPs, the simulator's bubble)."""
    cores = os.cpu_count() or 1
    ratios = {r["name"]: r["step_time_s"]["predicted"] / r["step_time_s"]["cpu"] for r in results
              if 1 < r["world"] <= cores}
    assert len(ratios) >= 8
    middle = statistics.median(ratios.values())
    assert 1 / 3 <= middle <= 3, ratios
    assert all(1 / 3 <= x / middle <= 3 for x in ratios.values()), (middle, ratios)

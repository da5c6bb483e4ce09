"""The planner against the jobs (minitrain/plan/validate.py): 14 runs of examples.mlp / examples.gpt under
mpiexec at 1-8 ranks (DDP, ZeRO-1/2/3, offload, fp16, GPipe, 1F1B, ZB-V, interleaved, TP, TP+SP, 3D,
recomputation), predicted from the committed machine constants (machines/cpu-2core.json). Memory: every
rank's ledger peak, every category, within 5%. Graph nodes per step: exactly the engine's count. Step time,
where ranks fit the cores: the CPU time of the step's own thread outside its waits (busy), in units of the
anchor run beside it (which the machine's other jobs slow alike), within 20% of the prediction (README: the
figures, the wall clock beside them, and what oversubscription does)."""
import os

import pytest

from minitrain.plan import validate


@pytest.fixture(scope="module")
def results():
    return [validate.run(name, "cpu-2core", timeout=240) for name in validate.RUNS]


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
def test_graph_nodes_of_a_step_are_the_planners_count(results):
    """The Work the time model charges holds the nodes the engine records (the rank that records the most)."""
    for res in results:
        assert res["nodes"]["measured"] == res["nodes"]["predicted"], (res["name"], res["nodes"])


@pytest.mark.slow
def test_step_time_within_20_percent_where_ranks_fit_the_cores(results):
    """Busy CPU time (the step's own thread, waits left out) in anchors, against the planner's compute plus the
    busy part of its collectives: every run whose ranks fit the cores within 20%. Oversubscribed runs (4 and 8
    ranks on 2 cores) are left out: their ranks take turns on the cores and evict each other's caches. A run
    outside the band is run once more and judged by the second measurement (CI shares its cores)."""
    cores = os.cpu_count() or 1
    ratios = {r["name"]: validate.busy_ratio(r) for r in results if r["world"] <= cores}
    assert len(ratios) >= 9 or cores < 2, ratios
    first = dict(ratios)
    for name, x in first.items():          # a run outside the band is measured once more: one job on a shared
        if not 0.8 <= x <= 1.2:            # machine can be disturbed as a whole (both measurements are reported)
            ratios[name] = validate.busy_ratio(validate.run(name, "cpu-2core", timeout=240))
    assert all(0.8 <= x <= 1.2 for x in ratios.values()), {"first": first, "again": ratios}

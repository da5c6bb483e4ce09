"""The planner prices a tensor-parallel layer's collectives as they run in a job, right after the layer's
arithmetic (plan/alpha_beta.collective(after_compute=True): the calibrated "cold" fits), and every other
collective at its best case. Exact checks only: how many calls, by how much; how close it comes to a job's
clock is scripts/bench_planner.py's to say."""
import copy

import pytest

from minitrain import plan
from minitrain.plan.alpha_beta import collective
from minitrain.plan.validate import planned

EXTRA = 1e-4                       # seconds per ring step added by the cold fits below


def without_cold():
    """cpu-2core as calibrated before the cold and in-a-job fits existed: each collective at its best case only."""
    machine = copy.deepcopy(plan.load_machine("cpu-2core"))
    for table in machine["collectives"].values():
        for fit in table.values():
            for key in [k for k in fit if k.startswith(("cold_", "job_"))]:
                del fit[key]
    return machine


def with_cold(extra=EXTRA):
    """cpu-2core with cold fits = each collective's best-case busy CPU plus ``extra`` per step."""
    machine = without_cold()
    for table in machine["collectives"].values():
        for fit in table.values():
            fit.update(cold_busy_alpha_s=fit["busy_alpha_s"] + extra, cold_busy_beta_s_per_byte=fit["busy_beta_s_per_byte"])
    return machine


def test_a_collective_after_compute_takes_the_cold_fit_and_only_then():
    warm, cold = without_cold(), with_cold()
    for busy in (False, True):
        best = collective(cold, "ring_all_reduce", 1 << 14, 2, busy=busy)
        assert best == collective(warm, "ring_all_reduce", 1 << 14, 2, busy=busy)
        # a ring all-reduce at p = 2: 2 steps
        assert collective(cold, "ring_all_reduce", 1 << 14, 2, busy=busy, after_compute=True) == pytest.approx(
            best + 2 * EXTRA, rel=1e-12)
        # a machine calibrated before the cold fits existed: the best case
        assert collective(warm, "ring_all_reduce", 1 << 14, 2, busy=busy, after_compute=True) == best


def test_where_the_ranks_outnumber_the_cores_a_collective_after_compute_takes_the_nearest_cold_excess():
    """calibrate fits the cold busy CPU only where the ranks fit the cores (p = 2 here): at p = 4 a collective
    after compute is p = 4's best case plus the same array's cold excess at p = 2 (its copies and its call's
    Python from memory: a ring all-reduce's 2 steps there and its bytes, not p = 4's 6 steps)."""
    machine = with_cold()
    for table in machine["collectives"].values():
        for fit in table["4"], table["2"]:
            fit.update(cold_busy_beta_s_per_byte=fit["busy_beta_s_per_byte"] + EXTRA / (1 << 20))
        del table["4"]["cold_busy_alpha_s"], table["4"]["cold_busy_beta_s_per_byte"]
    sent = 2 / 2 * (1 << 14)                           # a ring all-reduce at p = 2: 2 steps, 2(p-1)/p of the bytes
    for busy in (False, True):
        best = collective(machine, "ring_all_reduce", 1 << 14, 4, busy=busy)
        assert collective(machine, "ring_all_reduce", 1 << 14, 4, busy=busy, after_compute=True) == pytest.approx(
            best + 2 * EXTRA + sent * EXTRA / (1 << 20), rel=1e-12)
    assert collective(without_cold(), "ring_all_reduce", 1 << 14, 4, busy=True, after_compute=True) == \
        collective(without_cold(), "ring_all_reduce", 1 << 14, 4, busy=True)


def test_a_collective_after_compute_takes_at_least_its_in_a_job_wall():
    """Its wall: the larger of the best case plus the cold CPU work and the in-a-job fit (ranks arriving apart,
    each waiting for the other's jitter); its busy CPU stays the cold fit's."""
    machine = with_cold()
    for fit in machine["collectives"]["ring_all_reduce"].values():
        fit.update(job_alpha_s=fit["alpha_s"] + 3 * EXTRA, job_beta_s_per_byte=fit["beta_s_per_byte"])
    cold, best = with_cold(), collective(machine, "ring_all_reduce", 1 << 14, 2)
    assert collective(machine, "ring_all_reduce", 1 << 14, 2, after_compute=True) == pytest.approx(
        best + 2 * 3 * EXTRA, rel=1e-12)
    assert collective(machine, "ring_all_reduce", 1 << 14, 2, busy=True, after_compute=True) == collective(
        cold, "ring_all_reduce", 1 << 14, 2, busy=True, after_compute=True)
    for fit in machine["collectives"]["ring_all_reduce"].values():      # below the cold wall: the cold wall
        fit.update(job_alpha_s=fit["alpha_s"] + EXTRA / 2)
    assert collective(machine, "ring_all_reduce", 1 << 14, 2, after_compute=True) == pytest.approx(
        best + 2 * EXTRA, rel=1e-12)


# ring steps of a step's tensor-parallel collectives at p = 2 (an all-reduce 2, a reduce-scatter or all-gather 1),
# as plan/layer_costs.py counts them: the embedding's g and the head's f, the loss's 3 all-reduces, and per block
# g twice forward and f twice backward (sequence parallelism: g a reduce-scatter forward and an all-gather
# backward, f an all-gather forward, a reduce-scatter and the input gathered again backward)
@pytest.mark.parametrize("options, steps", [
    ("--tp 2 --n-embd 128", lambda layers: 2 * (1 + 1 + 3) + 2 * 4 * layers),
    ("--tp 2 --sequence-parallel --n-embd 128", lambda layers: (2 + 3 + 2 * 3) + 10 * layers)])
def test_each_tensor_parallel_collective_of_a_step_pays_its_cold_cost_once(options, steps):
    model, layout = planned("gpt", 2, options)
    warm, cold = (plan.predict(model, layout, m) for m in (without_cold(), with_cold()))
    extra = steps(model.n_layer) * EXTRA
    assert cold["step_time_s"]["comm"] - warm["step_time_s"]["comm"] == pytest.approx(extra, rel=1e-9)
    assert cold["step_busy_s"] - warm["step_busy_s"] == pytest.approx(extra, rel=1e-9)


def test_collectives_outside_a_layer_stay_at_their_best_case():
    for kind, world, options in (("mlp", 2, "--hidden 256"), ("mlp", 2, "--strategy zero3 --hidden 256"),
                                 ("gpt", 2, "--zero 1"), ("gpt", 1, "")):
        model, layout = planned(kind, world, options)
        warm, cold = (plan.predict(model, layout, m)["step_time_s"] for m in (without_cold(), with_cold()))
        assert cold == warm, (kind, options)

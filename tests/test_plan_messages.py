"""The planner's pipeline messages and its median step (plan/time.py, plan/job_overheads.py): a calibrated
stage-to-stage message goes to the schedule's simulator, between virtual stages each at its own cost; the
CPU work of a job's median step is the calibrated best case times the anchor's median over its best.
Exact checks only (what is passed where, by how much it scales); how close it comes to a job's clock is
scripts/bench_planner.py's to say."""
import time

import pytest

from minitrain import plan
from minitrain.parallel.pipeline import get_schedule, simulate
from minitrain.plan import collective_fits, job_overheads
from minitrain.plan import time as ptime
from minitrain.plan.bubble import _simulated
from minitrain.plan.validate import planned

GPT_PP = "--pp 2 --schedule 1f1b --microbatches 4"          # micro-batches of 4 x 32 tokens x 64 floats
SIMULATED = _simulated


def uncalibrated():
    """cpu-2core without the constants under test: no message cost, no median-step factors."""
    return {k: v for k, v in plan.load_machine("cpu-2core").items()
            if not k.startswith(("pipeline_message", "typical"))}


def messaging(**extra):
    return {**uncalibrated(), "pipeline_message_s": 2e-4, "pipeline_message_byte_s": 1e-9, **extra}


def recorded(monkeypatch, machine, kind, options, world=2):
    """(prediction, [the arguments of every _simulated call])."""
    calls, original = [], SIMULATED

    def spy(*args):
        calls.append(args)
        return original(*args)
    monkeypatch.setattr(ptime, "_simulated", spy)         # where predict_time looks it up (plan/bubble.py's)
    model, layout = planned(kind, world, options)
    return plan.predict(model, layout, machine), calls


def test_a_calibrated_message_goes_between_the_stages_of_the_simulated_schedule(monkeypatch):
    predicted, calls = recorded(monkeypatch, messaging(), "gpt", GPT_PP)
    assert len(calls) == 1
    name, p, m, v, f, b, message, w = calls[0]
    assert (name, p, m, v) == ("1f1b", 2, 4, 1) and len(f) == len(b) == len(w) == 2
    assert message == float(f"{2e-4 + 1e-9 * 4 * 32 * 64 * 4:.3g}")   # the activation of a micro-batch (3 digits)
    assert f[1] > f[0]                                           # each stage its own: the last holds the head
    span = simulate(get_schedule("1f1b", 2, 4), forward_cost=f, backward_cost=b, message_cost=message)["total_time"]
    slowest = max(fk + bk for fk, bk in zip(f, b))
    t = predicted["step_time_s"]
    assert t["bubble"] == pytest.approx(span - m * slowest, rel=1e-2)    # (stage costs to 3 digits)
    assert predicted["bubble_fraction"] == pytest.approx(t["bubble"] / span, rel=1e-2)


def test_a_light_stage_hides_messages_from_a_heavy_one_and_a_costlier_message_costs_more(monkeypatch):
    """ZB-V's four virtual stages at their own costs (W each one's weight gradients: plan/work.py's Work.w): no
    longer than all at the slowest's; and the bubble grows with the message (none: the simulator's span with
    free messages)."""
    predicted, calls = recorded(monkeypatch, messaging(), "mlp", "--strategy pipeline --schedule zbv "
                                "--microbatches 4 --layers 3 --hidden 256 --batch-size 128")
    name, p, m, v, f, b, message, w = calls[0]
    assert (name, p, m, v, len(f)) == ("zbv", 2, 4, 2, 4) and len(set(f)) > 1
    assert all(0 < wk <= bk for wk, bk in zip(w, b)) and any(abs(wk - bk / 2) > bk / 20 for wk, bk in zip(w, b))
    placed = get_schedule("zbv", 2, 4)
    own = SIMULATED(name, p, m, v, f, b, message, w)
    heavy = [max(f[k] + b[k] for k in (i, 3 - i)) for i in range(2)]     # zbv: rank 0 holds 0 and 3, rank 1: 1, 2
    worst_b, worst_w = max(x - y for x, y in zip(b, w)), max(w)
    assert own <= SIMULATED(name, p, m, v, (max(f),) * 4, (worst_b + worst_w,) * 4, message, (worst_w,) * 4)
    free = simulate(placed, forward_cost=f, backward_cost=tuple(x - y for x, y in zip(b, w)), weight_cost=w)["total_time"]
    assert free < own and m * max(heavy) <= free
    dearer, _ = recorded(monkeypatch, messaging(pipeline_message_s=1e-3), "mlp", "--strategy pipeline --schedule zbv "
                         "--microbatches 4 --layers 3 --hidden 256 --batch-size 128")
    assert dearer["step_time_s"]["bubble"] > predicted["step_time_s"]["bubble"]
    assert dearer["step_time_s"]["compute"] == predicted["step_time_s"]["compute"]


def test_without_a_calibrated_message_the_pipeline_pays_a_p2p_per_action(monkeypatch):
    predicted, calls = recorded(monkeypatch, uncalibrated(), "gpt", GPT_PP)
    assert calls == [] and predicted["step_time_s"]["comm"] > 0


def test_a_median_step_runs_at_the_anchors_median_speed(monkeypatch):
    """Compute scales by the anchor's median over its best: every rank of a job at once where world > 1,
    alone for one rank, after a wait asleep for a pipeline's stages (not its tail); communication does not."""
    base = uncalibrated()
    typical = {**base, "typical_job": 1.5, "typical_alone": 1.25, "typical_job_waited": 2.0}
    assert (ptime.typical(typical, 2), ptime.typical(typical, 1), ptime.typical(typical, 2, True)) == (1.5, 1.25, 2.0)
    assert ptime.typical(base, 2) == 1.0 and ptime.typical({**typical, "typical_job": 0.5}, 2) == 1.0   # never < best
    assert ptime.typical({**typical, "typical_job_waited": 1.2}, 2, True) == 1.5      # a stage: never < the job's
    for world, factor in ((2, 1.5), (1, 1.25)):
        model, layout = planned("mlp", world, "--hidden 256 --batch-size 128")
        plain, slow = (plan.predict(model, layout, m)["step_time_s"] for m in (base, typical))
        assert slow["compute"] == pytest.approx(factor * plain["compute"], rel=1e-12)
        assert slow["comm"] == plain["comm"]
    pipeline = "--strategy pipeline --schedule 1f1b --microbatches 4 --layers 3 --hidden 256 --batch-size 128"
    (plain, calls), (slow, slow_calls) = (recorded(monkeypatch, messaging(**m), "mlp", pipeline)
                                          for m in ({}, {k: typical[k] for k in ("typical_job", "typical_job_waited")}))
    (call,), (slow_call,) = set(calls), set(slow_calls)          # (predict prices the step more than once)
    m, f, b = call[2], call[4], call[5]
    assert slow_call[4] == pytest.approx([2 * x for x in f], rel=5e-3) and slow_call[5] == pytest.approx(
        [2 * x for x in b], rel=5e-3)                                    # the stages: after a wait
    stages = m * max(x + y for x, y in zip(f, b))
    tail = plain["step_time_s"]["compute"] - stages                      # the optimizer, the actions: back to back
    assert slow["step_time_s"]["compute"] == pytest.approx(2 * stages + 1.5 * tail, rel=2e-3)


def test_a_line_through_the_messages():
    """calibrate's fit of a message's seconds over its bytes: exact through a line; never negative."""
    a, b = job_overheads._line([(n, 1e-4 + 2e-9 * n) for n in (2048, 16384, 65536, 131072)])
    assert a == pytest.approx(1e-4, rel=1e-9) and b == pytest.approx(2e-9, rel=1e-9)
    assert job_overheads._line([(2048, 3e-4), (16384, 2e-4), (131072, 1e-4)]) == (2e-4, 0.0)   # falling: the median
    assert job_overheads._line([(2048, 0.0), (16384, 2e-4), (65536, 0.0)]) == (2e-4, 0.0)    # 0: no receiver waited


def test_a_pipeline_action_cost_seen_only_at_the_largest_activation_is_priced_per_byte():
    """One 128 KiB point is a per-byte cost of the runtime's actions, not ~100 us on every action of a small job."""
    assert job_overheads._line([(2048, 0.0), (16384, 0.0), (131072, 1e-4)], alone="per_byte") == (0.0, 1e-4 / 131072)
    assert job_overheads._line([(2048, 0.0), (131072, 1e-4)]) == (1e-4, 0.0)      # a message: its latency


def test_a_wrappers_cost_is_the_median_of_back_to_back_pairs():
    """Each pair's busy CPU difference, not each half's best: 2 ms of work less 1 ms of work, whatever the load."""
    def burn(seconds):
        def work():
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
        return work
    assert job_overheads._paired_busy(burn(2e-3), burn(1e-3), 9) == pytest.approx(1e-3, abs=4e-4)


def test_a_slow_spell_in_one_series_of_the_anchor_is_outvoted(monkeypatch):
    """calibrate's typical_job and typical_job_waited: the median of three series, not the one series a spell
    of the machine slowed (it priced every pipeline 1.4x)."""
    series = iter([1.10, 1.20, 1.50, 1.45, 1.12, 1.18])       # (job, waited) in turn; the second pair slowed
    monkeypatch.setattr(job_overheads, "typical_over_best", lambda comm, repeats, sleep=0.0: next(series))
    assert job_overheads._typical_in_a_job(None) == {"typical_job": 1.12, "typical_job_waited": 1.20}
    spread = [(1.10, 1.20), (1.50, 1.45), (1.12, 1.18)]        # taken by calibrate between its rounds
    assert job_overheads._typical_in_a_job(None, spread) == {"typical_job": 1.12, "typical_job_waited": 1.20}


def test_a_spell_in_one_round_of_the_in_a_job_collectives_is_outvoted():
    """calibrate's in-a-job timings: each key measured once per round, every key in turn before the next round
    (one key's rounds seconds apart), the lowest round kept; a spell that slows the second round does not
    price the collective."""
    order, rounds = [], iter(range(100))
    spell = {("ring_all_gather", 4096): [(1e-4, 9e-5), (3e-4, 2e-4), (1.2e-4, 8e-5)],
             ("ring_all_gather", 65536): [(2e-4, 1e-4), (6e-4, 5e-4), (1.8e-4, 1.1e-4)]}

    def measure(key):
        order.append(key)
        return spell[key][len([k for k in order if k == key]) - 1]
    lowest = collective_fits.lowest_of_rounds(list(spell), measure, 3, lambda: order.append(next(rounds)))
    assert lowest == {("ring_all_gather", 4096): (1e-4, 8e-5), ("ring_all_gather", 65536): (1.8e-4, 1e-4)}
    keys = list(spell)
    assert order == [*keys, 0, *keys, 1, *keys, 2]           # every key in a round, then the next round


def _scaled_job_fits(machine, k):
    """A copy of ``machine`` whose collectives' in-a-job fits are k times its own (k None: no such fits)."""
    out = {**machine, "collectives": {}}
    for name, table in machine["collectives"].items():
        out["collectives"][name] = {p: {key: (v * k if key.startswith("job_") and isinstance(v, float) else v) for key, v in fit.items()
                                        if k is not None or not key.startswith("job_")} for p, fit in table.items()}
    return out


def test_fsdp_collectives_on_the_progress_thread_are_priced_as_a_job_meets_them():
    """ZeRO-3's gathers and scatters run on the progress thread beside the compute: the calibrated in-a-job fit
    prices them (all of the step's comm), the best case where none was measured; ZeRO-1's own collectives keep
    the best case."""
    machine = plan.load_machine("cpu-2core")
    zero3 = planned("mlp", 2, "--strategy zero3 --recompute full --layers 4 --hidden 256")
    comm = {k: ptime.predict_time(*zero3, _scaled_job_fits(machine, k))["comm"] for k in (1.0, 2.0, None)}
    assert comm[2.0] == pytest.approx(2 * comm[1.0], rel=1e-12) and comm[None] < comm[1.0]
    zero1 = planned("mlp", 2, "--strategy zero1 --hidden 256")
    assert ptime.predict_time(*zero1, _scaled_job_fits(machine, 2.0))["comm"] == \
        ptime.predict_time(*zero1, _scaled_job_fits(machine, 1.0))["comm"]

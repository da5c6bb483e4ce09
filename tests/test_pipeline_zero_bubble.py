"""Zero-bubble schedules (ZB-H1, ZB-V), unequal stages, the measured bubble's causes and the
timeline picture: simulated idle equals the paper's (p-1)(F+B-W) per stage, a third of 1F1B's,
ZB-V's is no more; both keep 1F1B's peak memory; both equal one process in float64 (p = 1..4,
m below / at / above p, 2D too); an uneven cut is reported with the bubble it implies; the
causes of the measured bubble add up to measured minus formula."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import trace
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel.pipeline import (Action, PipelineParallel, ScheduleError, check_schedule,
                                         formula_bubble_fraction, get_schedule, implied_bubble, placement,
                                         simulate)
from minitrain.parallel.pipeline.measure import split_idle
from minitrain.parallel.pipeline.partition import counted_costs, stage_table
from test_pipeline import assert_equal_to_reference, batches, make_model, pipeline_run, reference_run


# ---------------------------------------------------------------- the schedules, simulated
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w_a_third_of_1f1b(p):
    for m in (p, p + 1, 2 * p, 16):
        zb = simulate(get_schedule("zb_h1", p, m), 1.0, 1.0, 1.0)
        one = simulate(get_schedule("1f1b", p, m), 1.0, 1.0, 1.0)      # B + W as one backward
        assert zb["idle_per_stage"] == pytest.approx([(p - 1) * (1 + 1 - 1)] * p)
        assert one["idle_per_stage"] == pytest.approx([(p - 1) * (1 + 1 + 1)] * p)
        assert zb["bubble_fraction"] == pytest.approx((p - 1) / (3 * m + p - 1))
        assert formula_bubble_fraction("zb_h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
        unequal = simulate(get_schedule("zb_h1", p, m), 1.0, 1.2, 0.8)   # any W <= F
        assert unequal["idle_per_stage"] == pytest.approx([(p - 1) * (1 + 1.2 - 0.8)] * p)
    for m in range(1, p):                        # fewer micro-batches than stages: still no worse
        zb = simulate(get_schedule("zb_h1", p, m), 1.0, 1.0, 1.0)["idle_per_stage"]
        assert max(zb) <= (p - 1) * 3


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zbv_idles_no_more_than_zb_h1(p):
    for m in range(1, 17):
        zbv = simulate(get_schedule("zbv", p, m), 0.5, 0.5, 0.5)        # two half-size chunks per stage
        h1 = simulate(get_schedule("zb_h1", p, m), 1.0, 1.0, 1.0)
        assert max(zbv["idle_per_stage"]) <= max(h1["idle_per_stage"]) + 1e-12
        assert zbv["total_time"] <= h1["total_time"] + 1e-12
    if p > 1:                                     # and strictly less once the V is full
        m = 2 * p
        assert simulate(get_schedule("zbv", p, m), .5, .5, .5)["total_time"] < \
            simulate(get_schedule("zb_h1", p, m), 1, 1, 1)["total_time"]


@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (3, 3), (4, 2), (4, 8), (4, 16), (6, 12)])
def test_zero_bubble_schedules_keep_1f1b_peak_activation_memory(p, m):
    peak_1f1b = max(simulate(get_schedule("1f1b", p, m))["peak_activations"])
    assert peak_1f1b == min(p, m)
    assert simulate(get_schedule("zb_h1", p, m))["peak_activations"] == [min(p, m)] * p
    zbv = simulate(get_schedule("zbv", p, m))["peak_activations"]            # in half-stage chunks
    assert max(zbv) / 2 <= peak_1f1b


def test_zbv_is_a_v_and_hands_over_at_its_bottom():
    schedule = get_schedule("zbv", 3, 4)
    assert placement(schedule) == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    bottom = [a for a in schedule[2] if a.kind == "F" and a.chunk == 0]
    assert all(a.send_to == 2 for a in bottom)     # virtual 2 -> 3 stays on rank 2
    assert [a for a in schedule[0] if a.kind == "F" and a.chunk == 1][0].send_to is None   # the loss: rank 0
    assert get_schedule("zbv", 3, 4, chunks=2) == schedule
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        get_schedule("zbv", 3, 4, chunks=3)


def test_simulate_runs_b_plus_w_as_one_backward_when_not_split():
    for name in ("gpipe", "1f1b", "interleaved_1f1b"):
        schedule = get_schedule(name, 2, 4)
        assert simulate(schedule, 1.0, 1.5, 0.5)["timeline"] == simulate(schedule, 1.0, 2.0)["timeline"]
    split = simulate(get_schedule("zb_h1", 2, 4), 1.0, 1.5, 0.5)["timeline"]
    assert {end - start for row in split for a, start, end in row if a.kind == "W"} == {0.5}


def test_unequal_stages_gpipe_takes_their_sum_plus_m_minus_1_times_the_slowest():
    costs, p, m = [1.0, 3.0, 2.0], 3, 5
    sim = simulate(get_schedule("gpipe", p, m), costs, [2 * c for c in costs])
    assert sim["total_time"] == pytest.approx(sum(3 * c for c in costs) + (m - 1) * 3 * max(costs))
    assert simulate(get_schedule("1f1b", p, m), [2.0] * p, [4.0] * p) == simulate(get_schedule("1f1b", p, m), 2.0, 4.0)
    expected = 1 - m * 3 * sum(costs) / (p * sim["total_time"])
    assert implied_bubble(get_schedule("gpipe", p, m), costs) == pytest.approx(expected)
    assert implied_bubble(get_schedule("gpipe", p, m), [5.0] * p) == pytest.approx((p - 1) / (m + p - 1))


def test_the_checker_rejects_w_before_b_and_a_missing_w():
    good = get_schedule("zb_h1", 2, 2)
    assert check_schedule(good)
    early = [[a for a in good[0] if a.kind != "W"], good[1]]
    early[0].insert(1, Action("W", 0))
    with pytest.raises(ScheduleError, match="before its input-gradient backward"):
        check_schedule(early)
    missing = [[a for a in good[0] if str(a) != "W1"], good[1]]
    with pytest.raises(ScheduleError, match="never computes W1"):
        check_schedule(missing)


# ---------------------------------------------------------------- the runtime
@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zero_bubble_schedules_equal_one_process(schedule, p):
    depth = 2 * p                                # zbv: 2p virtual stages, each with a Linear
    reference, ref_losses = reference_run(depth=depth)
    init = make_model(depth).state_dict()
    for m in sorted({1, 2, p, 2 * p}):           # m < p, m = p, m > p
        if 24 % m == 0:
            results = ThreadWorld(p).run(pipeline_run, init, schedule, m, None, depth=depth)
            assert_equal_to_reference(results, reference, ref_losses)


def test_zbv_in_2d_equals_one_process_and_needs_no_chunks():
    depth = 4
    reference, _ = reference_run(depth=depth)
    init = make_model(depth).state_dict()
    assert_equal_to_reference(ThreadWorld(4).run(pipeline_run, init, "zbv", 3, None, dp=2, depth=depth), reference)

    def chunks(comm):
        return PipelineParallel(make_model(depth), comm, schedule="zbv", num_microbatches=2).v
    assert ThreadWorld(2).run(chunks) == [2, 2]


# ---------------------------------------------------------------- what the job reports
def test_the_stage_table_names_layers_and_cost_shares():
    model = make_model()
    rows = stage_table(list(model), [0, 3, 9], [112, 0, 272, 0, 204, 0, 156, 0, 39], [(0, 0), (1, 0)])
    assert rows[0]["layers"] == ["0:Linear", "1:ReLU", "2:Linear"] and rows[1]["rank"] == 1
    assert rows[0]["cost_share"] == pytest.approx(384 / 783) and rows[1]["cost"] == 399


def test_counted_cost_is_f_plus_b_plus_w_and_the_first_layer_has_no_b():
    """3n multiply-adds per row for a layer of n parameters, 2n for the first (its input gradient is
    never computed): a first Linear 3/2 as wide does the work of any other, so the split is even."""
    assert counted_costs([0, 6, 0, 4, 4]) == [0, 12, 0, 12, 12]
    widths = [48] + [32] * 8
    model = mt.nn.Sequential(*[layer for i in range(8) for layer in (mt.nn.Linear(widths[i], 32), mt.nn.ReLU())])

    class Stub:
        size, rank = 4, 0
    pipe = PipelineParallel(model, Stub(), "1f1b", 4)
    assert [sum(name.endswith("Linear") for name in row["layers"]) for row in pipe.stage_rows] == [2, 2, 2, 2]
    assert [row["cost_share"] for row in pipe.stage_rows] == pytest.approx([0.25] * 4, rel=0.01)


def test_the_step_ends_with_an_all_reduce_every_rank_takes_part_in():
    """The measured step ends when the last rank leaves: an all-reduce of the loss, which no rank
    leaves before every rank has entered (a broadcast from the last stage would let it go early)."""
    x, y = batches(1)[0]

    def fn(comm):
        mt.set_default_dtype(np.float64)
        pipe = PipelineParallel(make_model(4), comm, "1f1b", 4)
        comm.stats.reset()
        loss = pipe.train_step(x, y, F.cross_entropy)
        return loss, {name: e for name, e in comm.stats.by_name.items() if name not in ("p2p", "check_collectives")}   # the header check is check_collectives's own message
    results = ThreadWorld(3).run(fn)
    assert len({loss for loss, _ in results}) == 1
    for _, collectives in results:
        assert list(collectives) and all("all_reduce" in name for name in collectives), collectives
        assert sum(e["calls"] for e in collectives.values()) == 1
        assert all(e["messages_sent"] >= 1 and e["messages_received"] >= 1 for e in collectives.values())


def test_split_idle_on_a_hand_made_step():
    """GPipe, p = 2, m = 1. Rank 0 starts the step at 0: F0 [1, 3], sends [3, 3.5], waits for B0's
    gradient [4, 8], B0 [8, 9.5], 0.3 s at the end, leaves at 10. Rank 1 entered early (-1): waits
    for F0 [-0.5, 4], F0 [4, 5.5], B0 [5.5, 7.5], sends [7.5, 7.7], 2 s at the end, leaves at 10.2."""
    nan = np.nan
    rows = np.array([[[0.0, 10.0, 0.3, 0.0, 1, 3, nan, nan, 3, 3.5, 8, 9.5, 4, 8, nan, nan]],
                     [[-1.0, 10.2, 2.0, 0.0, 4, 5.5, -0.5, 4, nan, nan, 5.5, 7.5, nan, nan, 7.5, 7.7]]])
    wall, bubble, causes = split_idle(rows, get_schedule("gpipe", 2, 1), first_rank=0)
    assert wall.tolist() == [10.2]
    assert bubble[:, 0] == pytest.approx([1 - 3.5 / 10.2, 1 - 3.5 / 10.2])
    expected = {"waiting": [3.7 + 0.3 + 0.2, 3.5 + 2.0], "message_transfer": [0.3, 0.5], "send": [0.5, 0.2],
                "python_overhead": [1.0 + 0.5 + 0.2, 0.5], "dp_all_reduce": [0, 0], "late_start": [0, 0]}
    for name, values in expected.items():
        assert causes[name][:, 0] * 10.2 == pytest.approx(values), name
    assert sum(causes.values())[:, 0] == pytest.approx(bubble[:, 0])


def traced_pipeline(comm, init, schedule):
    """A float64 pipeline of make_model(4) from ``init``, m = 4, with this rank's trace on."""
    mt.set_default_dtype(np.float64)
    model = make_model(4)
    model.load_state_dict(init)
    trace.enable(rank=comm.rank)
    return PipelineParallel(model, comm, schedule, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_the_measured_bubble_is_split_into_causes_that_add_up(schedule):
    init = make_model(4).state_dict()

    def fn(comm):
        pipe = traced_pipeline(comm, init, schedule)
        for x, y in batches(3):
            pipe.train_step(x, y, F.cross_entropy)
        ops = [e["args"]["op"] for e in trace.events() if e.get("args", {}).get("op")]
        return pipe.measured_bubble(), ops
    for summary, ops in ThreadWorld(2).run(fn):
        assert summary["steps_measured"] == 2
        residual = summary["residual_by_cause"]
        assert sum(residual.values()) == pytest.approx(summary["measured_bubble_fraction"] -
                                                       summary["formula_bubble_fraction"], abs=1e-9)
        assert all(residual[k] >= 0 for k in ("message_latency", "message_overhead", "python_overhead", "late_start"))
        assert all(0 <= b < 1 for b in summary["measured_bubble_fraction_per_rank"])
        assert ops.count("W") == (3 * 4 * 2 if schedule == "zbv" else 0)
        if schedule == "gpipe":
            assert summary["formula_bubble_fraction"] == pytest.approx(1 / 5)


def test_the_bubble_of_a_batch_size_leaves_the_other_batches_out_even_past_the_records_kept(monkeypatch):
    from minitrain.parallel.pipeline import stamps
    monkeypatch.setattr(stamps, "MAX_RECORDS", 3)       # kept: the first step and the last two
    init = make_model(4).state_dict()
    rows = [8, 5, 5, 8, 5, 8]

    def fn(comm):
        pipe = traced_pipeline(comm, init, "1f1b")
        for (x, y), n in zip(batches(len(rows)), rows):
            pipe.train_step(x[:n], y[:n], F.cross_entropy)
        return pipe.measured_bubble(global_rows=8), pipe.measured_bubble(global_rows=6), pipe.measured_bubble()
    for eights, none_of_that_size, every in ThreadWorld(2).run(fn):
        assert (eights["steps_measured"], eights["steps_left_out"]) == (1, 1)       # steps 4 (5 rows) and 5 (8)
        assert (none_of_that_size["steps_measured"], none_of_that_size["steps_left_out"]) == (2, 0)   # all kept
        assert (every["steps_measured"], every["steps_left_out"]) == (2, 0)
        assert eights["measured_bubble_fraction"] == pytest.approx(eights["measured_bubble_fraction_per_step"][-1])


def test_the_timeline_draws_simulated_above_measured_with_a_legend_that_covers_nothing(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from minitrain.parallel.pipeline.timeline import COLORS, plot_pipeline
    init = make_model(4).state_dict()

    def fn(comm):
        pipe = traced_pipeline(comm, init, "zb_h1")
        x, y = batches(1)[0]
        pipe.train_step(x, y, F.cross_entropy)
        return trace.events(), pipe.schedule
    results = ThreadWorld(2).run(fn)
    events = results[0][0] + results[1][0]
    schedule = results[0][1]
    fig = plot_pipeline(schedule, simulate(schedule, 1.0, 1.0, 1.0), events, {0: 0, 1: 1}, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim()                           # one time axis
    assert [t.get_text() for t in bottom.get_yticklabels()] == ["rank 0: stage 0", "rank 1: stage 1"]
    legend = fig.legends[0]
    assert {t.get_text().split(":")[0] for t in legend.get_texts()} >= {"F", "B", "W", "send / recv wait",
                                                                         "idle / Python overhead"}
    fig.canvas.draw()
    box = legend.get_window_extent()
    for ax in (top, bottom):
        assert not box.overlaps(ax.get_window_extent())
    drawn = {tuple(np.round(bar.get_facecolor()[:3], 3)) for bar in bottom.patches}
    wanted = {tuple(np.round(matplotlib.colors.to_rgb(COLORS[k]), 3)) for k in ("F", "B", "W", "wait", "idle")}
    assert len(wanted) == 5 and wanted <= drawn                          # five distinct colours, all drawn


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_new_batch_shape_sends_the_shapes_again(schedule):
    """Message shapes are learned once per batch shape (a header, then payloads alone): a step with
    another batch size must not reuse the old shapes."""
    mt.set_default_dtype(np.float64)
    depth = 4
    model = make_model(depth)
    data = [(x[:n], y[:n]) for (x, y), n in zip(batches(4), (24, 12, 24, 12))]
    reference = []
    for x, y in data:
        model.zero_grad()
        F.cross_entropy(model(mt.Tensor(x)), y).backward()
        reference.append({n: q.grad.copy() for n, q in model.named_parameters()})
    init = make_model(depth).state_dict()

    def fn(comm):
        mt.set_default_dtype(np.float64)
        m = make_model(depth)
        m.load_state_dict(init)
        pipe = PipelineParallel(m, comm, schedule, 4)
        grads = []
        for x, y in data:
            pipe.zero_grad()
            pipe.train_step(x, y, F.cross_entropy)
            grads.append({n: q.grad.copy() for n, q in pipe.named_parameters()})
        return grads
    for grads in ThreadWorld(2).run(fn):
        for step, expected in zip(grads, reference):
            for name, value in step.items():
                np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_every_w_action_computes_its_micro_batchs_weight_gradients(schedule, monkeypatch):
    """B leaves the weights alone and W does their work, for every micro-batch (not only the first)."""
    from minitrain.autograd import WeightGradients
    run = WeightGradients.run
    queued = []

    def counting_run(self):
        queued.append(len(self))
        return run(self)
    monkeypatch.setattr(WeightGradients, "run", counting_run)
    init = make_model(4).state_dict()

    def fn(comm):
        mt.set_default_dtype(np.float64)
        model = make_model(4)
        model.load_state_dict(init)
        pipe = PipelineParallel(model, comm, schedule, 4)
        for x, y in batches(2):
            pipe.train_step(x, y, F.cross_entropy)
    ThreadWorld(2).run(fn)
    assert len(queued) == 2 * 2 * 4 * (2 if schedule == "zbv" else 1)     # steps x ranks x m x chunks
    assert min(queued) >= 1                          # every virtual stage here holds a Linear

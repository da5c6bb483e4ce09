"""Pipeline parallelism: schedules simulate to the literature's bubble and in-flight counts, the
checker rejects broken schedules, and the runtime equals single-process training (float64, 1e-10)
for every synchronous schedule at p = 2, 3, 4, m below / at / above p, in 2D (dp x pp) too;
PipeDream-2BW equals a single-process emulation of its delayed-gradient update rule."""
import re

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim, trace
from minitrain.comm import DeviceMesh, ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel.pipeline import (Action, PipelineParallel, ScheduleError, balanced_split_points,
                                         check_schedule, format_schedule, formula_bubble_fraction, get_schedule,
                                         simulate)


# ---------------------------------------------------------------- schedules and the simulator
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "naive"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_bubble_equals_the_formula_exactly_with_unit_costs(name, p):
    for m in (1, 2, 3, 4, 8, 12):
        for v in ((1, 2, 3) if name == "interleaved_1f1b" else (1,)):
            if name == "interleaved_1f1b" and m % p:
                continue
            result = simulate(get_schedule(name, p, m, chunks=v), forward_cost=1.0, backward_cost=2.0)
            assert result["bubble_fraction"] == pytest.approx(formula_bubble_fraction(name, p, m, v), abs=1e-12)
            # the total time is (v·m + p - 1) chunk steps of f + b (naive: m·p of them)
            steps = m * p if name == "naive" else v * m + p - 1
            assert result["total_time"] == pytest.approx(3.0 * steps)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 3), (2, 5)])
def test_micro_batches_in_flight_gpipe_m_and_1f1b_min_p_minus_s_m(p, m):
    assert simulate(get_schedule("gpipe", p, m))["peak_activations"] == [m] * p
    assert simulate(get_schedule("1f1b", p, m))["peak_activations"] == [min(p - s, m) for s in range(p)]


def test_interleaving_cuts_the_bubble_by_v():
    p, m = 4, 8
    bubbles = [simulate(get_schedule("interleaved_1f1b", p, m, chunks=v), 1.0 / v, 2.0 / v)["bubble_fraction"]
               for v in (1, 2, 4)]
    assert bubbles == pytest.approx([3 / 11, 3 / 19, 3 / 35])


def test_pipedream_2bw_has_no_flush_between_batches():
    p, m = 4, 4
    one = simulate(get_schedule("pipedream_2bw", p, m, steps=1))["bubble_fraction"]
    many = simulate(get_schedule("pipedream_2bw", p, m, steps=10))["bubble_fraction"]
    assert one == pytest.approx(3 / 7) and many == pytest.approx(3 / 43)     # amortised towards 0


def test_a_schedule_prints_as_rows_of_actions():
    text = format_schedule(get_schedule("1f1b", 2, 3))
    assert text.splitlines() == ["stage 0: F0 F1 B0 F2 B1 B2", "stage 1: F0 B0 F1 B1 F2 B2"]
    first = get_schedule("1f1b", 2, 3)[0][0]
    assert first == Action("F", 0, 0, None, 1)


def test_the_checker_rejects_deadlocks_and_causality_violations():
    good = get_schedule("1f1b", 2, 2)
    assert check_schedule(good)
    # each stage waits for the other: stage 1 starts with micro-batch 1, which stage 0 sends only
    # after micro-batch 0's backward, which needs stage 1
    crossed = [[Action("F", 0, 0, None, 1), Action("B", 0, 0, 1, None), Action("F", 1, 0, None, 1),
                Action("B", 1, 0, 1, None)],
               [Action("F", 1, 0, 0, None), Action("B", 1, 0, None, 0), Action("F", 0, 0, 0, None),
                Action("B", 0, 0, None, 0)]]
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits at B0"):
        check_schedule(crossed)
    backwards_first = [list(reversed(good[0])), good[1]]
    with pytest.raises(ScheduleError, match="before its forward"):
        check_schedule(backwards_first)
    missing = [good[0], good[1][:-1]]
    with pytest.raises(ScheduleError, match="never computes B1"):
        check_schedule(missing)


def test_bad_schedule_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of the number of stages"):
        get_schedule("interleaved_1f1b", 4, 6, chunks=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        get_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="needs the interleaved_1f1b"):
        get_schedule("1f1b", 2, 2, chunks=2)


def test_balanced_split_points():
    assert balanced_split_points([112, 0, 272, 0, 204, 0, 156, 0, 39], 4) == [1, 3, 5]   # max 272
    assert balanced_split_points([33, 0, 263, 0, 263, 0, 263, 0, 5], 2) == [3]
    assert balanced_split_points([10, 10, 10, 10], 4) == [1, 2, 3]
    assert balanced_split_points([100, 1, 1, 1], 2) == [1]
    with pytest.raises(ValueError, match="at least one layer"):
        balanced_split_points([1, 1], 3)


# ---------------------------------------------------------------- the runtime
def make_model(depth=0):
    """5 Linear layers with ReLUs between; ``depth`` > 0: that many Linear(16, 16) without ReLUs
    in between (for many virtual stages)."""
    mt.manual_seed(0)
    if depth:
        return nn.Sequential(nn.Linear(6, 16), *[nn.Linear(16, 16) for _ in range(depth)], nn.Linear(16, 3))
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
                         nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))


def batches(steps=3, n=24):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((n, 6)), rng.integers(0, 3, n)) for _ in range(steps)]


def reference_run(opt_class=optim.Adam, lr=1e-2, steps=3, n=24, depth=0):
    mt.set_default_dtype(np.float64)
    model = make_model(depth)
    opt = opt_class(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(steps, n):
        opt.zero_grad()
        loss = F.cross_entropy(model(mt.Tensor(x)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def init_pipeline(comm, init, schedule, m, v=1, depth=0, dp_comm=None):
    """The test model from ``init`` (float64) cut into a pipeline over ``comm``."""
    mt.set_default_dtype(np.float64)
    model = make_model(depth)
    model.load_state_dict(init)
    return PipelineParallel(model, comm, schedule, m, chunks=v, dp_comm=dp_comm)


def pipeline_run(comm, init, schedule, m, v=1, opt_class=optim.Adam, lr=1e-2, steps=3, n=24, dp=1, depth=0):
    if dp > 1:
        mesh = DeviceMesh(comm, dp=dp, pp=comm.size // dp)
        pp_comm, dp_comm = mesh.comm("pp"), mesh.comm("dp")
    else:
        pp_comm, dp_comm = comm, None
    pipe = init_pipeline(pp_comm, init, schedule, m, v, depth, dp_comm)
    opt = opt_class(pipe.parameters(), lr=lr)
    losses = []
    for x, y in batches(steps, n):
        if dp > 1:                               # each replica takes its share of the global batch
            r, d = dp_comm.rank, dp
            x, y = x[r::d], y[r::d]
        opt.zero_grad()
        losses.append(pipe.train_step(x, y, F.cross_entropy, global_rows=n))
        opt.step()
    return pipe.full_state_dict(), losses


def test_zero_grad_keeping_zeroed_buffers_equals_one_process():
    """pipe.zero_grad(set_to_none=False), PyTorch's module call: the stages' gradients are zeroed in place."""
    reference, ref_losses = reference_run(optim.SGD, lr=0.1)
    init = make_model().state_dict()

    def fn(comm):
        pipe = init_pipeline(comm, init, "1f1b", 3)
        opt = optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step, (x, y) in enumerate(batches()):
            pipe.zero_grad(set_to_none=False)
            assert step == 0 or all(q.grad is not None and not q.grad.any() for q in pipe.parameters())
            losses.append(pipe.train_step(x, y, F.cross_entropy))
            opt.step()
        return pipe.full_state_dict(), losses
    assert_equal_to_reference(ThreadWorld(2).run(fn), reference, ref_losses)


def assert_equal_to_reference(results, reference, ref_losses=None):
    for state, losses in results:
        for name, value in reference.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-10, err_msg=name)
        if ref_losses is not None:
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_synchronous_schedules_equal_one_process(schedule, p):
    reference, ref_losses = reference_run()
    init = make_model().state_dict()
    for m in sorted({1, 2, p, 2 * p}):          # m < p, m = p, m > p
        if 24 % m:
            continue
        assert_equal_to_reference(ThreadWorld(p).run(pipeline_run, init, schedule, m), reference, ref_losses)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (2, 2, 2), (2, 6, 3), (3, 3, 2), (4, 4, 2), (4, 8, 3)])
def test_interleaved_1f1b_equals_one_process(p, m, v):
    depth = p * v                               # p·v virtual stages, each with a Linear
    reference, ref_losses = reference_run(depth=depth)
    init = make_model(depth).state_dict()
    assert_equal_to_reference(ThreadWorld(p).run(pipeline_run, init, "interleaved_1f1b", m, v, depth=depth),
                              reference, ref_losses)


@pytest.mark.parametrize("schedule, p, v", [("gpipe", 3, 1), ("1f1b", 2, 1), ("interleaved_1f1b", 2, 2),
                                           ("zb_h1", 2, 1), ("zbv", 2, 2), ("pipedream_2bw", 2, 1)])
def test_eval_step_gives_one_process_s_outputs_and_loss_without_a_graph(schedule, p, v):
    """eval_step (PyTorch's schedule.eval): the last stage's rank gets the whole batch's outputs, every rank
    the mean loss, as one process's forward; batches that m does not divide, fewer rows than m, no loss; the
    loop rounds of interleaved and zbv; after a training step (2BW: the weights it updated); no gradient made,
    and the next training step as it would be without the evaluations."""
    depth = p * v
    init = make_model(depth).state_dict()
    (x, y), = batches(1, 7)

    def fn(comm):
        pipe = init_pipeline(comm, init, schedule, 4, v, depth)
        pipe.train_step(*batches(1, 6)[0], F.cross_entropy)
        optim.SGD(pipe.parameters(), lr=0.5).step()
        pipe.zero_grad()
        found = [pipe.eval_step(x[:n], y[:n], F.cross_entropy) for n in (7, 2)] + [pipe.eval_step(x)]
        assert all(q.grad is None for q in pipe.parameters())
        state = pipe.full_state_dict()
        return pipe.rank == pipe.where[-1][0], found, state, pipe.train_step(x[:6], y[:6], F.cross_entropy)

    results = ThreadWorld(p).run(fn)
    model = make_model(depth)
    model.load_state_dict(results[0][2])
    for last, found, _, next_loss in results:
        if schedule != "pipedream_2bw":          # whose next step computes on the weights before the update
            np.testing.assert_allclose(next_loss, F.cross_entropy(model(mt.Tensor(x[:6])), y[:6]).item(), rtol=1e-12)
        for (out, loss), n, with_loss in zip(found, (7, 2, 7), (True, True, False)):
            expected = model(mt.Tensor(x[:n]))
            assert (out is not None) == last
            if last:
                np.testing.assert_allclose(out, expected.numpy(), rtol=1e-12, atol=1e-12)
            if with_loss:
                np.testing.assert_allclose(loss, F.cross_entropy(expected, y[:n]).item(), rtol=1e-12)
            else:
                assert loss is None
    assert sum(r[0] for r in results) == 1


def test_2d_data_and_pipeline_parallel_equal_one_process():
    reference, ref_losses = reference_run()
    init = make_model().state_dict()
    assert_equal_to_reference(ThreadWorld(4).run(pipeline_run, init, "1f1b", 3, dp=2), reference)


@pytest.mark.parametrize("schedule, m, n, dp", [("1f1b", 5, 24, 1), ("gpipe", 30, 24, 1), ("zb_h1", 4, 23, 2),
                                                ("1f1b", 3, 5, 2), ("1f1b", 2, 1, 2)])
def test_batches_that_m_or_dp_do_not_divide_equal_one_process(schedule, m, n, dp):
    """Uneven micro-batches (m > n: empty ones) and replicas (n < dp: one without rows), each
    micro-batch's loss weighted by its rows over the global batch's."""
    reference, ref_losses = reference_run(n=n)
    init = make_model().state_dict()
    results = ThreadWorld(2 * dp).run(pipeline_run, init, schedule, m, n=n, dp=dp)
    assert_equal_to_reference(results, reference)
    # each replica returns its rows' share of the loss: their mean is the global batch's
    np.testing.assert_allclose(np.mean([losses for _, losses in results], axis=0), ref_losses, rtol=1e-10)


def test_pipeline_errors_are_clear():
    init = make_model().state_dict()

    def run(comm, **kwargs):
        return pipeline_run(comm, init, **kwargs)
    with pytest.raises(ValueError, match="multiple of the number of stages"):
        ThreadWorld(2).run(run, schedule="interleaved_1f1b", m=3, v=2)

    def too_many_stages(comm):
        PipelineParallel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), comm, "gpipe", 2)
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        ThreadWorld(3).run(too_many_stages)
    with pytest.raises(TypeError, match="nn.Sequential"):
        PipelineParallel(nn.Linear(2, 2), ThreadWorld(1).comms[0], "gpipe", 1)

    def evaluate(comm, *args):
        PipelineParallel(make_model(), comm, "gpipe", 2).eval_step(*args)
    (x, y), = batches(1, 4)
    with pytest.raises(ValueError, match="give both y and loss_fn"):
        ThreadWorld(2).run(evaluate, x, y)
    with pytest.raises(ValueError, match="x has 4 rows and y 3"):
        ThreadWorld(2).run(evaluate, x, y[:3], F.cross_entropy)


def test_each_rank_holds_only_its_stage():
    def fn(comm):
        mt.set_default_dtype(np.float64)
        model = make_model()
        pipe = PipelineParallel(model, comm, "1f1b", 2, split_points=[3, 6])
        from minitrain import memory
        return [n for n, _ in pipe.named_parameters()], memory.snapshot()["params"]
    (names0, bytes0), (names1, _), (names2, _) = ThreadWorld(3).run(fn)
    assert names0 == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert names1 == ["4.weight", "4.bias"] and names2 == ["6.weight", "6.bias", "8.weight", "8.bias"]
    mine = (6 * 16 + 16 + 16 * 16 + 16) * 8                 # the other stages' weights are freed
    assert mine <= bytes0 <= mine + 6 * 8                   # (6 one-element placeholders keep their shapes)


def test_pipedream_2bw_follows_its_delayed_gradient_rule():
    """W(t+1) = W(t) - lr·∇L(W(t-1); batch t), with W(-1) = W(0): emulated in one process."""
    mt.set_default_dtype(np.float64)
    lr = 0.1
    model = make_model()
    previous = {n: q.data.copy() for n, q in model.named_parameters()}
    for x, y in batches(4):
        current = {n: q.data.copy() for n, q in model.named_parameters()}
        for n, q in model.named_parameters():             # the gradient at the stashed version
            q.data[...] = previous[n]
        model.zero_grad()
        F.cross_entropy(model(mt.Tensor(x)), y).backward()
        for n, q in model.named_parameters():
            q.data[...] = current[n] - lr * q.grad
        previous = current
    expected = model.state_dict()
    init = make_model().state_dict()
    results = ThreadWorld(2).run(pipeline_run, init, "pipedream_2bw", 4, opt_class=optim.SGD, lr=lr, steps=4)
    assert_equal_to_reference(results, expected)
    synchronous, _ = reference_run(optim.SGD, lr, steps=4)
    assert not np.allclose(results[0][0]["0.weight"], synchronous["0.weight"])   # it is not synchronous SGD


def test_the_measured_bubble_comes_from_the_trace():
    init = make_model().state_dict()

    def fn(comm):
        pipe = init_pipeline(comm, init, "gpipe", 4)
        trace.enable(rank=comm.rank)
        x, y = batches(1)[0]
        pipe.train_step(x, y, F.cross_entropy)
        ops = [e["name"] for e in trace.events() if e.get("args", {}).get("op")]
        return pipe.measured_bubble_fraction(), pipe.formula_bubble_fraction(), ops
    for r, (measured, formula, ops) in enumerate(ThreadWorld(2).run(fn)):
        assert len(measured) == 2 and all(0.0 <= b < 1.0 for b in measured) and formula == pytest.approx(1 / 5)
        assert ops == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]


@pytest.mark.parametrize("kwargs, said", [
    (dict(num_microbatches=2.5), "an integer >= 1 of stages and of micro-batches (num_microbatches), got 1 and 2.5"),
    (dict(num_microbatches=True), "got 1 and True"),
    (dict(schedule="interleaved_1f1b", chunks=2.5), "interleaved_1f1b: chunks must be an integer >= 1, got 2.5"),
    (dict(layer_costs=[float("nan"), 1, 1, 1, 1]), "layer costs must be finite numbers >= 0"),
    (dict(layer_costs=[-1, 1, 1, 1, 1]), "layer costs must be finite numbers >= 0")])
def test_a_pipeline_s_counts_and_costs_are_refused_in_their_own_words(kwargs, said):
    """A fractional count ended in range()'s "'float' object cannot be interpreted as an integer", True was taken as
    one micro-batch, and a NaN or negative layer cost cut the stages at random (every cut priced alike)."""
    kwargs = {"schedule": "gpipe", "num_microbatches": 2, **kwargs}
    with pytest.raises(ValueError, match=re.escape(said)):
        PipelineParallel(nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)]), ThreadWorld(1).comms[0], **kwargs)

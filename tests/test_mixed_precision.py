"""Mixed precision: float16/bfloat16 compute, fp32 master weights, dynamic loss scaling, and the
ZeRO paper's (2 + 2 + K)Ψ accounting with K = 12 at every stage, measured."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import memory, nn, optim
from minitrain.backend import bfloat16
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import (DistributedDataParallel, FullyShardedDataParallel, ZeroRedundancyOptimizer,
                                found_inf_on_any_rank)
from minitrain.parallel.zero_memory import MIXED_PRECISION_ADAM, model_state_bytes

LOW = [np.float16, bfloat16]


def data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 30)), rng.integers(0, 10, n)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_ops_keep_the_low_precision_and_cast_is_differentiable(dtype):
    x = mt.Tensor(np.linspace(-1, 1, 12).reshape(3, 4), requires_grad=True)
    w = mt.Tensor(np.ones((5, 4)), requires_grad=True)
    low = x.to(dtype)
    y = F.linear(low, w.to(dtype)) * 2.0 + 1.0                 # bf16 matmul accumulates in fp32
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype   # gradients come back in fp64
    np.testing.assert_allclose(x.grad, np.full((3, 4), 10.0))
    np.testing.assert_allclose(w.grad, np.tile(2 * x.data.sum(0), (5, 1)), rtol=1e-2)


def test_a_leafs_gradient_has_the_leafs_dtype():
    p = nn.Parameter(np.ones(3, np.float16))
    (p.to(np.float32) * 3.0).sum().backward()
    assert p.grad.dtype == np.float16


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_master_weights_step_exactly_like_fp32_adam_on_the_unscaled_gradient(dtype):
    mt.manual_seed(0)
    model = nn.MLP([30, 16, 10]).to(dtype)
    opt = optim.MixedPrecisionOptimizer(model.parameters(), optim.Adam, lr=1e-2)
    shadow = [mt.Tensor(q.data.astype(np.float32), requires_grad=True) for q in model.parameters()]
    shadow_opt = optim.Adam(shadow, lr=1e-2)
    x, y = data()
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(mt.Tensor(x).to(dtype)).float(), y)
        opt.scale(loss).backward()
        for s, q in zip(shadow, model.parameters()):
            s.grad = q.grad.astype(np.float32) / np.float32(opt.loss_scale)
        assert opt.step()
        shadow_opt.step()
        for s, m, q in zip(shadow, opt.masters, model.parameters()):
            np.testing.assert_array_equal(m.data, s.data)            # fp32 masters: bit-equal
            np.testing.assert_array_equal(q.data, s.data.astype(dtype))   # params: the masters rounded
    assert opt.loss_scale == (2.0 ** 16 if dtype == np.float16 else 1.0)


def test_clipping_uses_the_norm_of_the_unscaled_gradient():
    """With fp16's loss scale S = 2**16 the gradients are S times too large (and S·g squared
    overflows fp16): opt.clip_grad_norm_ clips by the true norm, summed in float64."""
    mt.manual_seed(0)
    model = nn.MLP([30, 16, 10]).to(np.float16)
    opt = optim.MixedPrecisionOptimizer(model.parameters(), optim.SGD, lr=1e-2)
    x, y = data()
    opt.scale(F.cross_entropy(model(mt.Tensor(x).to(np.float16)).float(), y)).backward()
    true = [q.grad.astype(np.float64) / opt.loss_scale for q in model.parameters()]
    want = np.sqrt(sum((g * g).sum() for g in true))
    assert opt.clip_grad_norm_(want / 4) == pytest.approx(want, rel=1e-12)
    after = np.sqrt(sum((q.grad.astype(np.float64) ** 2).sum() for q in model.parameters())) / opt.loss_scale
    assert after == pytest.approx(want / 4, rel=1e-2)          # clipped in fp16: rounding only


def test_fsdp_clips_fp16_shards_by_the_unscaled_norm_and_their_optimizer_refuses_to():
    """Shards need the norm summed across ranks: fsdp.clip_grad_norm_(max_norm, loss_scale=S) gives what
    one process's opt.clip_grad_norm_ gives (every rank has the same data: the reduced shards are exact);
    the shards' MixedPrecisionOptimizer, which sees one rank's part, refuses."""
    x, y = data()

    def loss_of(model, opt):
        return opt.scale(F.cross_entropy(model(mt.Tensor(x).to(np.float16)).float(), y))

    def fn(comm):
        mt.set_default_dtype(np.float32)
        mt.manual_seed(0)
        fsdp = FullyShardedDataParallel(nn.MLP([30, 16, 10]).to(np.float16), comm)
        opt = optim.MixedPrecisionOptimizer(fsdp.parameters(), optim.SGD, loss_scale=256.0, lr=0.1,
                                            all_reduce_found_inf=found_inf_on_any_rank(comm))
        loss_of(fsdp, opt).backward()
        with pytest.raises(ValueError, match="shards"):
            opt.clip_grad_norm_(1e-3)
        return fsdp.clip_grad_norm_(1e-3, loss_scale=opt.loss_scale)
    mt.set_default_dtype(np.float32)
    mt.manual_seed(0)
    model = nn.MLP([30, 16, 10]).to(np.float16)
    opt = optim.MixedPrecisionOptimizer(model.parameters(), optim.SGD, loss_scale=256.0, lr=0.1)
    loss_of(model, opt).backward()
    want = opt.clip_grad_norm_(1e-3)
    assert ThreadWorld(2).run(fn) == pytest.approx([want, want], rel=1e-12)


def test_dynamic_loss_scale_skips_overflow_backs_off_and_grows():
    model = nn.Linear(4, 2).to(np.float16)
    opt = optim.MixedPrecisionOptimizer(model.parameters(), optim.SGD, lr=0.1, growth_interval=2)
    before = [q.data.copy() for q in model.parameters()]
    for q in model.parameters():
        q.grad = np.full(q.shape, np.inf, np.float16)
    assert opt.step() is False and opt.loss_scale == 2.0 ** 15 and opt.skipped_steps == 1
    for q, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(q.data, b)                     # nothing moved
    for _ in range(2):
        for q in model.parameters():
            q.grad = np.ones(q.shape, np.float16)
        assert opt.step() is True
    assert opt.loss_scale == 2.0 ** 16                                # doubled after 2 clean steps


def test_loss_scaling_rescues_gradients_that_underflow_in_fp16():
    # a gradient of 1e-8 is below fp16's smallest subnormal (6e-8): unscaled it becomes 0
    w = nn.Parameter(np.ones(1, np.float16))
    x = mt.Tensor(np.array([1e-8], np.float32))
    (w.to(np.float32) * x).sum().backward()
    assert float(w.grad[0]) == 0.0
    w.grad = None
    opt = optim.MixedPrecisionOptimizer([w], optim.SGD, loss_scale=1024.0, lr=1e6)
    opt.scale((w.to(np.float32) * x).sum()).backward()
    assert float(w.grad[0]) == pytest.approx(1024e-8, rel=1e-2)      # representable once scaled
    assert opt.step()
    assert float(opt.masters[0].data[0]) == pytest.approx(1 - 1e6 * 1e-8, rel=1e-4)   # unscaled in fp32


def test_mixed_precision_trains_a_model():
    mt.manual_seed(0)
    x, y = data(64)
    model = nn.MLP([30, 32, 10]).to(np.float16)
    opt = optim.MixedPrecisionOptimizer(model.parameters(), optim.Adam, lr=1e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = F.cross_entropy(model(mt.Tensor(x).to(np.float16)).float(), y)
        opt.scale(loss).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_parameters_of_the_wrong_dtype_are_refused():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        optim.MixedPrecisionOptimizer(nn.Linear(2, 2).parameters(), optim.SGD, lr=0.1)


def _initial_state():
    rng = np.random.default_rng(0)                    # dyadic weights: exact in fp16 and bf16
    return {"weight": rng.integers(-8, 9, (10, 30)) / 8.0, "bias": rng.integers(-8, 9, 10) / 8.0}   # 310 parameters


def _exact_data(n=32, seed=0):
    """Inputs in {-1, 0, 1} and integer output weights: every gradient of the loss below is a small
    multiple of 1/n, exact in fp16 and bf16 and in any order of summation."""
    rng = np.random.default_rng(seed)
    return rng.integers(-1, 2, (n, 30)).astype(np.float64), rng.integers(-2, 3, (n, 10)).astype(np.float32)


def _train_mixed(comm, stage, dtype, init, steps=3):
    """Rank r takes rows r::p of one global batch (different data on every rank, so that a wrong
    reduction, a max instead of a mean, shows), and the loss makes every gradient exact: ZeRO must
    then equal one process on the whole batch bit for bit."""
    model = nn.Linear(30, 10)
    model.load_state_dict(init)
    model.to(dtype)
    scale = 256.0 if dtype == np.float16 else None     # fixed: a rank's local sum must not overflow where the mean would not
    if stage in (1, 2):
        opt, forward = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, comm, stage=stage,
                                               bucket_cap_mb=0.001, loss_scale=scale, lr=1e-2), model
    elif stage == 3:
        forward = FullyShardedDataParallel(model, comm)
        opt = optim.MixedPrecisionOptimizer(forward.parameters(), optim.Adam,
                                            all_reduce_found_inf=found_inf_on_any_rank(comm), loss_scale=scale, lr=1e-2)
    else:
        opt, forward = optim.MixedPrecisionOptimizer(model.parameters(), optim.Adam, loss_scale=scale, lr=1e-2), model
    x, c = _exact_data()
    x, c = x[comm.rank::comm.size], c[comm.rank::comm.size]
    persistent = None
    for _ in range(steps):
        opt.zero_grad()
        loss = (F.relu(forward(mt.Tensor(x).to(dtype))).float() * mt.Tensor(c)).sum() * (1.0 / len(x))
        opt.scale(loss).backward()
        opt.step()
        if persistent is None:
            live = memory.snapshot()
            persistent = {c: live[c] for c in ("params", "grads", "optimizer_state")}
    state = forward.full_state_dict() if stage == 3 else {n: q.data.copy() for n, q in model.named_parameters()}
    return state, persistent, model.num_parameters()


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_mixed_precision_equals_one_process_and_model_states_are_2_2_12(stage, p, dtype):
    init = _initial_state()
    reference, _, _ = ThreadWorld(1).run(_train_mixed, 0, dtype, init)[0]
    for state, persistent, psi in ThreadWorld(p).run(_train_mixed, stage, dtype, init):
        for name, value in reference.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)
        formula = model_state_bytes(psi, p, stage, **MIXED_PRECISION_ADAM)
        pad = 4 * 16 * p          # up to p-1 padding elements per flat buffer (one per FSDP unit)
        for c in ("params", "grads", "optimizer_state"):
            assert formula[c] <= persistent[c] <= formula[c] + pad, (c, persistent[c], formula[c])


def test_the_masters_leave_the_memory_tracker_with_their_optimizer():
    import gc
    from minitrain import memory
    before = memory.snapshot()["optimizer_state"]
    model = nn.MLP([30, 24, 10]).to(np.float16)
    opt = optim.MixedPrecisionOptimizer(model.parameters(), optim.Adam, lr=1e-3)
    assert memory.snapshot()["optimizer_state"] == before + 4 * model.num_parameters()
    del opt
    gc.collect()
    assert memory.snapshot()["optimizer_state"] == before


def test_sharded_ranks_skip_together_when_only_one_shard_overflows():
    """ZeRO-1 in fp16 on 2 ranks: the gradient overflows in rank 1's shard only (element 7 of
    [0, 4) / [4, 8)), yet both ranks skip the step and keep equal weights: the optimizer received
    the reduction (all_reduce_found_inf) and every rank took the same decision."""
    def body(comm):
        w = nn.Parameter(np.ones(8, np.float16))
        zero = ZeroRedundancyOptimizer([w], optim.SGD, comm, stage=1, lr=0.1)
        x = np.ones(8, np.float32)
        x[7] = 1e6                               # beyond float16's 65504: its gradient is inf
        (w.to(np.float32) * mt.Tensor(x)).sum().backward()
        zero.step()
        return zero.optimizer.skipped_steps, w.data.copy()
    results = ThreadWorld(2).run(body)
    assert [skipped for skipped, _ in results] == [1, 1]
    assert all(np.array_equal(weights, np.ones(8, np.float16)) for _, weights in results)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")    # the mean's sum, on purpose
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_16_bit_gradients_seeded_with_1_over_p_then_summed_keep_one_process_s_range(strategy):
    """fp16 near the top of its range (65504): one process's gradient 3 x 2^13 = 24576 fits, and so does each of 4
    replicas' (the same rows everywhere). Averaged by reduce_op="mean" (summed, then divided) the replicas' sum,
    98304, overflows and every rank skips a step one process takes; seeded with 1/4 and summed (reduce_op="sum",
    PyTorch DDP's order) each holds 6144, the sum is 24576, and the step is one process's, bit for bit."""
    big = 3.0 * 2 ** 13

    def body(comm, reduce_op):
        model = nn.Linear(2, 1, bias=False)
        model.weight.data[...] = 1.0
        model.to(np.float16)
        if strategy.startswith("zero"):
            forward, opt = model, ZeroRedundancyOptimizer(model.parameters(), optim.SGD, comm, stage=int(strategy[-1]),
                                                          loss_scale=1.0, reduce_op=reduce_op, lr=2.0 ** -20)
        else:
            forward = (DistributedDataParallel if strategy == "ddp" else FullyShardedDataParallel)(
                model, comm, reduce_op=reduce_op)
            opt = optim.MixedPrecisionOptimizer(forward.parameters(), optim.SGD, loss_scale=1.0, lr=2.0 ** -20,
                                                all_reduce_found_inf=found_inf_on_any_rank(comm))
        rows = 4 // comm.size
        loss = forward(mt.Tensor(np.ones((rows, 2), np.float16))).float().sum() * (big / rows)   # dL/dw = big
        loss.backward(np.asarray(1.0 / comm.size, np.float32) if reduce_op == "sum" else None)
        opt.step()
        skipped = (opt.optimizer if strategy.startswith("zero") else opt).skipped_steps
        weight = forward.full_state_dict()["weight"] if strategy == "fsdp" else model.weight.data
        return skipped, np.array(weight, dtype=np.float16)

    [(skipped, one_process)] = ThreadWorld(1).run(body, "mean")
    assert skipped == 0 and not np.array_equal(one_process, np.ones((1, 2), np.float16))
    for skipped, weight in ThreadWorld(4).run(body, "sum"):
        assert skipped == 0
        np.testing.assert_array_equal(weight, one_process)
    assert [skipped for skipped, _ in ThreadWorld(4).run(body, "mean")] == [1] * 4       # the sum overflowed


@pytest.mark.parametrize("make", [
    lambda comm: ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), optim.SGD, comm, reduce_op="avg", lr=1.0),
    lambda comm: FullyShardedDataParallel(nn.Linear(2, 2), comm, reduce_op="avg"),
    lambda comm: DistributedDataParallel(nn.Linear(2, 2), comm, reduce_op="avg")], ids=["zero", "fsdp", "ddp"])
def test_a_reduce_op_other_than_mean_or_sum_is_refused_by_name(make):
    with pytest.raises(ValueError, match=r"reduce_op must be 'mean' or 'sum', got 'avg'"):
        ThreadWorld(1).run(make)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_layer_norm_and_softmax_compute_16_bit_inputs_in_fp32(dtype):
    """Megatron's fused LayerNorm and fp32 attention softmax: the statistics of activations around 300 (squares past
    fp16's 65504) and a softmax over 4096 entries (a 16-bit sum of 2^12 terms rounds off) are fp32's, rounded once
    to the input's dtype; backward, from the saved 16-bit x̂, to 16-bit rounding of the largest gradient."""
    rng = np.random.default_rng(0)
    x = 300.0 + 30.0 * rng.standard_normal((2, 64))
    w, b = 1.0 + 0.1 * rng.standard_normal(64), 0.1 * rng.standard_normal(64)
    for op, args in ((lambda x, w, b: F.layer_norm(x, 64, w, b), (x, w, b)),
                     (lambda x: F.softmax(x, axis=-1), (0.01 * rng.standard_normal((2, 4096)),))):
        wide = [mt.Tensor(a.astype(dtype).astype(np.float32), requires_grad=True) for a in args]
        low = [mt.Tensor(a.astype(dtype), requires_grad=True) for a in args]
        want, got = op(*wide), op(*low)
        seed = rng.standard_normal(want.shape)
        want.backward(seed.astype(np.float32))
        got.backward(seed.astype(dtype))
        assert got.dtype == dtype and all(t.grad.dtype == dtype for t in low)
        np.testing.assert_array_equal(got.data, want.data.astype(dtype))        # fp32's result, rounded once
        for a, b_ in zip(low, wide):
            np.testing.assert_allclose(a.grad.astype(np.float32), b_.grad, rtol=0,
                                       atol=2.0 ** -7 * float(np.abs(b_.grad).max()))

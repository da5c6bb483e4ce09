"""Optimizer mechanics beyond the PyTorch oracle: state dicts, groups, zero_grad, clipping."""
import re

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.nn import functional as F


def train(model, opt, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x, y = rng.standard_normal((8, 4)), rng.integers(0, 3, 8)
        opt.zero_grad()
        F.cross_entropy(model(mt.Tensor(x)), y).backward()
        opt.step()


@pytest.mark.parametrize("make", [lambda ps: optim.Adam(ps, lr=1e-2),
                                  lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_state_dict_resumes_training_exactly(make, float64):
    mt.manual_seed(0)
    a = nn.MLP([4, 8, 3])
    b = nn.MLP([4, 8, 3])
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = make(a.parameters()), make(b.parameters())
    train(a, opt_a, 3, seed=1)
    train(b, opt_b, 3, seed=1)
    c = nn.MLP([4, 8, 3])
    c.load_state_dict(b.state_dict())
    opt_c = make(c.parameters())
    opt_c.load_state_dict(opt_b.state_dict())
    train(a, opt_a, 3, seed=2)
    train(c, opt_c, 3, seed=2)
    for p, q in zip(a.parameters(), c.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def test_param_groups_take_their_own_lr(float64):
    w1, w2 = nn.Parameter(np.ones(2)), nn.Parameter(np.ones(2))
    opt = optim.SGD([{"params": [w1]}, {"params": [w2], "lr": 0.5}], lr=0.1)
    w1.grad, w2.grad = np.ones(2), np.ones(2)
    opt.step()
    np.testing.assert_allclose(w1.data, 0.9)
    np.testing.assert_allclose(w2.data, 0.5)


def test_add_param_group_takes_the_defaults_and_refuses_a_parameter_already_in_a_group(float64):
    """PyTorch's fine-tuning idiom: unfreeze a layer and add it to the optimizer with its own lr."""
    w1, w2 = nn.Parameter(np.ones(2)), nn.Parameter(np.ones(2))
    opt = optim.SGD([w1], lr=0.1, momentum=0.9)
    opt.add_param_group({"params": w2, "lr": 0.5})
    assert opt.param_groups[1]["momentum"] == 0.9 and opt.param_groups[1]["params"] == [w2]
    w1.grad, w2.grad = np.ones(2), np.ones(2)
    opt.step()
    np.testing.assert_allclose(w1.data, 0.9)
    np.testing.assert_allclose(w2.data, 0.5)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [w1]})


def test_zero_grad_sets_none_or_zeros():
    w = nn.Parameter(np.ones(2, dtype=np.float32))
    opt = optim.SGD([w], lr=0.1)
    w.grad = np.ones(2, dtype=np.float32)
    opt.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(w.grad, 0)
    opt.zero_grad()
    assert w.grad is None


def test_parameters_without_gradients_are_skipped(float64):
    w = nn.Parameter(np.ones(2))
    optim.Adam([w]).step()
    np.testing.assert_array_equal(w.data, 1.0)


def test_clip_grad_norm_uses_the_global_norm(float64):
    a, b = nn.Parameter(np.zeros(1)), nn.Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0]), np.array([4.0])
    norm = optim.clip_grad_norm_([a, b], 1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose([a.grad[0], b.grad[0]], [0.6, 0.8], rtol=1e-6)


def test_clip_grad_norm_takes_a_single_tensor_as_pytorch(float64):
    """Iterated, a tensor gives its rows, which have no gradients: the norm read 0 and nothing was clipped."""
    w = nn.Parameter(np.zeros((2, 1)))
    w.grad = np.array([[3.0], [4.0]])
    assert optim.clip_grad_norm_(w, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(w.grad, [[0.6], [0.8]], rtol=1e-6)


@pytest.mark.parametrize("make", [lambda p: optim.SGD(p, lr=0.1), lambda p: optim.AdamW(p),
                                  lambda p: optim.MixedPrecisionOptimizer(p, optim.SGD, lr=0.1)])
def test_an_optimizer_given_a_single_tensor_refuses_it_as_pytorch(make):
    """Its rows would become the parameters, slices no backward reaches: every step would do nothing."""
    with pytest.raises(TypeError, match="iterable of tensors or dicts.*single tensor of shape \\(3, 2\\)"):
        make(nn.Parameter(np.zeros((3, 2), np.float16)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_clip_grad_norm_of_half_precision_gradients_is_their_norm_not_an_overflow(dtype):
    """300² overflows fp16 (its largest number is 65504): squared in their own precision the gradients' norm
    read inf and clipping zeroed them (PyTorch computes the norm in a wider type too)."""
    dt = mt.backend.bfloat16 if dtype == "bfloat16" else np.float16
    if dt is None:
        pytest.skip("no bfloat16 type (ml_dtypes)")
    w = nn.Parameter(np.zeros(400, dt))
    w.grad = np.full(400, 300.0, dt)
    norm = optim.clip_grad_norm_([w], 1.0)
    assert norm == pytest.approx(300.0 * 20.0, rel=1e-6)
    np.testing.assert_allclose(w.grad.astype(np.float64), 1 / 20.0, rtol=1e-2)


def test_clip_grad_norm_takes_pytorchs_positional_norm_type_and_refuses_other_norms(float64):
    """PyTorch's third argument is norm_type: clip_grad_norm_(params, 1.0, 2) is the L2 norm (it
    once set the total norm to 2, so nothing was measured), another norm is refused, and
    error_if_nonfinite raises on inf."""
    a, b = nn.Parameter(np.zeros(1)), nn.Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0]), np.array([4.0])
    assert optim.clip_grad_norm_([a, b], 1.0, 2) == pytest.approx(5.0)
    np.testing.assert_allclose([a.grad[0], b.grad[0]], [0.6, 0.8], rtol=1e-6)
    with pytest.raises(ValueError, match="norm_type=inf"):
        optim.clip_grad_norm_([a, b], 1.0, float("inf"))
    a.grad[0] = np.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        optim.clip_grad_norm_([a, b], 1.0, error_if_nonfinite=True)


def test_bad_hyper_parameters_are_rejected():
    w = nn.Parameter(np.ones(2))
    with pytest.raises(ValueError):
        optim.SGD([w], lr=-1)
    with pytest.raises(ValueError):
        optim.Adam([w], betas=(1.0, 0.9))
    with pytest.raises(ValueError):
        optim.SGD([], lr=0.1)


@pytest.mark.parametrize("make", [lambda w, v: optim.SGD([w], lr=v), lambda w, v: optim.SGD([w], lr=0.1, momentum=v),
                                  lambda w, v: optim.SGD([w], lr=0.1, weight_decay=v),
                                  lambda w, v: optim.Adam([w], lr=v), lambda w, v: optim.AdamW([w], lr=v),
                                  lambda w, v: optim.AdamW([w], eps=v), lambda w, v: optim.AdamW([w], weight_decay=v)])
@pytest.mark.parametrize("value", [float("nan"), -0.5])
def test_a_nan_or_negative_hyper_parameter_is_refused_as_pytorch_refuses_it(make, value):
    """`lr < 0` let NaN through (every step then made the weights NaN), and weight decay and momentum were not
    checked at all; PyTorch writes `not 0.0 <= lr`, which refuses both."""
    with pytest.raises(ValueError, match="invalid"):
        make(nn.Parameter(np.ones(2)), value)


@pytest.mark.parametrize("max_norm", [-1.0, float("nan"), None, "1", True])
def test_clip_grad_norm_refuses_a_max_norm_that_is_not_a_number_at_least_0(max_norm, float64):
    """A negative max_norm flipped every gradient's sign (the coefficient max_norm / norm below 1 was applied), NaN
    left the host's gradients unclipped and made the GPU's NaN; PyTorch takes both without a word."""
    w = nn.Parameter(np.zeros(2))
    w.grad = np.array([3.0, 4.0])
    with pytest.raises(ValueError, match="clip_grad_norm_: max_norm must be a number >= 0"):
        optim.clip_grad_norm_([w], max_norm)
    np.testing.assert_array_equal(w.grad, [3.0, 4.0])
    assert optim.clip_grad_norm_([w], float("inf")) == 5.0 and list(w.grad) == [3.0, 4.0]     # inf: measure only
    optim.clip_grad_norm_([w], 0.0)
    np.testing.assert_array_equal(w.grad, [0.0, 0.0])                                       # 0: every gradient 0


def test_a_sharded_clip_refuses_a_bad_max_norm_before_its_all_reduce():
    from minitrain.comm import ThreadWorld
    from minitrain.parallel.clip import clip_sharded_grad_norm_, sum_of_squares

    def fn(comm):
        w = nn.Parameter(np.zeros(2))
        w.grad = np.array([3.0, 4.0])
        with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
            clip_sharded_grad_norm_([w], -1.0, sum_of_squares([w.grad]), [comm])
        return comm.stats.by_name                 # no collective ran: the refusal came first on every rank
    assert ThreadWorld(2).run(fn) == [{}, {}]


@pytest.mark.parametrize("kwargs, said", [
    (dict(init_scale=0.0), "init_scale must be a positive finite number, got 0.0"),
    (dict(init_scale=float("inf")), "init_scale must be a positive finite number, got inf"),
    (dict(loss_scale=0.0), "loss_scale must be 'auto', 'dynamic', None or a positive finite number, got 0.0"),
    (dict(growth_factor=0.5), "growth_factor must be > 1, got 0.5"),
    (dict(backoff_factor=2.0), "backoff_factor must be in (0, 1), got 2.0"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1, got 0")])
def test_a_loss_scale_that_would_stop_training_is_refused(kwargs, said):
    """A scale of 0 zeroed every gradient and made every step an overflow (0 as a static loss_scale read as none);
    a growth below 1 or a backoff above 1 turned the scale's rule around (PyTorch's GradScaler asserts both)."""
    with pytest.raises(ValueError, match=re.escape(f"MixedPrecisionOptimizer: {said}")):
        optim.MixedPrecisionOptimizer([nn.Parameter(np.ones(2, np.float16))], optim.SGD, lr=0.1, **kwargs)


def test_a_schedule_that_would_divide_by_zero_at_its_first_step_is_refused():
    opt = optim.SGD([nn.Parameter(np.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="StepLR: step_size must be an integer >= 1, got 0"):
        optim.lr_scheduler.StepLR(opt, step_size=0)
    with pytest.raises(ValueError, match="CosineAnnealingLR: T_max must be > 0, got 0"):
        optim.lr_scheduler.CosineAnnealingLR(opt, T_max=0)
    with pytest.raises(ValueError, match="Linear: in_features and out_features must be >= 0, got -1, 3"):
        nn.Linear(-1, 3)

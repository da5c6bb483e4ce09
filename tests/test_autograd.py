"""The engine's contract: accumulation, hooks, saved-tensor hooks, grad mode, dtypes, freeing."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.nn import functional as F


def test_gradients_accumulate_across_backward_calls(float64):
    x = mt.Tensor([1.0, 2.0, 3.0], requires_grad=True)
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad, 2 * np.array([1.0, 2.0, 3.0]) + 3.0)


def test_passed_through_gradient_is_not_aliased_between_leaves(float64):
    # add passes its incoming gradient through unchanged to both inputs: the engine must not let
    # two leaves share one array, or accumulating into one would change the other
    a = mt.Tensor(np.ones(3), requires_grad=True)
    b = mt.Tensor(np.ones(3), requires_grad=True)
    (a + b).sum().backward()
    a.grad += 10
    np.testing.assert_array_equal(b.grad, np.ones(3))


def test_tensor_used_twice_gets_the_sum_of_both_paths(float64):
    x = mt.Tensor([2.0], requires_grad=True)
    y = x * 3.0
    (y + y * y).sum().backward()     # d/dx (3x + 9x^2) = 3 + 18x
    np.testing.assert_allclose(x.grad, [3 + 18 * 2.0])


def test_zero_dim_tensor_used_twice_gets_both_gradients(float64):
    # NumPy returns scalars, not arrays, for arithmetic on 0-d arrays: summing the second path's
    # gradient into the first "in place" must not drop it
    x = mt.Tensor(np.array(3.0), requires_grad=True)
    (x * x).backward()
    np.testing.assert_allclose(x.grad, 6.0)
    t = mt.Tensor([1.0, 2.0], requires_grad=True)
    s = t.sum()
    (s * s).backward()                # d/dt (sum t)^2 = 2 sum t
    np.testing.assert_allclose(t.grad, [6.0, 6.0])
    assert isinstance(t.grad, np.ndarray) and isinstance(x.grad, np.ndarray)


def test_non_scalar_backward_takes_the_incoming_gradient(float64):
    x = mt.Tensor(np.arange(3.0), requires_grad=True)
    y = x * 2.0
    with pytest.raises(RuntimeError, match="needs grad="):
        y.backward()
    y.backward(np.array([1.0, 10.0, 100.0]))
    np.testing.assert_array_equal(x.grad, [2.0, 20.0, 200.0])


def test_backward_frees_saved_arrays_unless_retain_graph(float64):
    x = mt.Tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad, 4 * np.ones(3))
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_no_grad_records_nothing(float64):
    x = mt.Tensor(np.ones(3), requires_grad=True)
    with mt.no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.grad_fn is None
    assert mt.is_grad_enabled()


def test_register_hook_on_non_leaf_can_replace_the_gradient(float64):
    x = mt.Tensor(np.ones(2), requires_grad=True)
    y = x * 3.0
    seen = []
    y.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 10.0)
    y.sum().backward()
    np.testing.assert_array_equal(seen[0], [1.0, 1.0])
    np.testing.assert_array_equal(x.grad, [30.0, 30.0])


def test_post_accumulate_grad_hook_fires_once_with_the_final_gradient(float64):
    # a tied weight used twice: the hook must see the sum of both uses, once per backward
    w = nn.Parameter(np.ones((2, 2)))
    calls = []
    w.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.copy()))
    x = mt.Tensor(np.ones((1, 2)))
    (F.linear(x, w).sum() + F.linear(x, w).sum() * 2.0).backward()
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0], np.full((2, 2), 3.0))


def test_post_accumulate_hooks_fire_last_layer_first(float64):
    model = nn.MLP([3, 4, 4, 2])
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    model(mt.Tensor(np.ones((2, 3)))).sum().backward()
    assert order[0].startswith("4.") and order[-1].startswith("0.")
    assert len(order) == 6


def test_hook_handle_removes_the_hook(float64):
    x = mt.Tensor(np.ones(2), requires_grad=True)
    calls = []
    handle = x.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    handle.remove()
    (x * 2.0).sum().backward()
    assert calls == []


def test_saved_tensors_hooks_pack_and_unpack(float64):
    packed = []

    def pack(a):
        packed.append(a.shape)
        return ("boxed", a.copy())

    def unpack(box):
        return box[1]
    x = mt.Tensor(np.arange(4.0), requires_grad=True)
    with mt.saved_tensors_hooks(pack, unpack):
        y = (x.exp() * x).sum()
    assert packed, "pack was never called"
    y.backward()
    np.testing.assert_allclose(x.grad, np.exp(np.arange(4.0)) * (1 + np.arange(4.0)))


def test_deep_graph_does_not_hit_the_recursion_limit():
    x = mt.Tensor(np.ones(1, dtype=np.float32), requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    y.sum().backward()
    assert x.grad[0] == 1.0


def test_float32_model_stays_float32_end_to_end():
    mt.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=9, block_size=4, n_layer=1, n_head=2, n_embd=8, dropout=0.1))
    idx = np.array([[1, 2, 3, 4]])
    logits, loss = model(idx, idx)
    assert logits.dtype == np.float32 and loss.dtype == np.float32
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == np.float32 and p.grad.dtype == np.float32, name
    opt = mt.optim.AdamW(model.parameters())
    opt.step()
    assert all(p.dtype == np.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == np.float32 for s in opt.state.values())


def test_float64_array_operand_does_not_widen_a_float32_tensor():
    x = mt.Tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    assert (x * np.ones(3)).dtype == np.float32
    assert (np.ones(3) + x).dtype == np.float32


@pytest.mark.parametrize("name, make, expected", [
    # (what, the result, PyTorch's dtype for it)
    ("fp16 * fp32", lambda h, f, i: h * f, np.float32),      # was fp16: the first operand's low precision won
    ("fp32 * fp16", lambda h, f, i: f * h, np.float32),
    ("bf16 + fp32", lambda h, f, i: h.to(mt.backend.bfloat16) + f, np.float32),
    ("bf16 * 0.5", lambda h, f, i: h.to(mt.backend.bfloat16) * 0.5, mt.backend.bfloat16),
    ("bf16 @ bf16", lambda h, f, i: h.to(mt.backend.bfloat16) @ h.to(mt.backend.bfloat16), mt.backend.bfloat16),
    ("fp32 + int64", lambda h, f, i: f + i, np.float32),     # NumPy: fp64
    ("int64 / int64", lambda h, f, i: i / i, np.float32),    # the default dtype; NumPy: fp64
    ("int64 + 0.5", lambda h, f, i: i + 0.5, np.float32),
    ("fp32 / np.sqrt(4)", lambda h, f, i: f / np.sqrt(4.0), np.float32),   # a NumPy float64 scalar
    ("fp32 * 0-d fp64", lambda h, f, i: f * mt.tensor(np.array(2.0)), np.float32),
    ("0-d fp32 * fp16", lambda h, f, i: mt.tensor(np.array(2.0, np.float32)) * h, np.float16),
])
def test_result_dtypes_follow_pytorchs_promotion(name, make, expected):
    if mt.backend.bfloat16 is None and "bf16" in name:
        pytest.skip("no bfloat16 type (ml_dtypes)")
    h = mt.Tensor(np.ones(3, np.float16), requires_grad=True)
    f = mt.Tensor(np.ones(3, np.float32), requires_grad=True)
    i = mt.Tensor(np.arange(1, 4))
    out = make(h, f, i)
    assert out.dtype == np.dtype(expected), f"{name}: {out.dtype}, PyTorch gives {np.dtype(expected)}"
    if out.requires_grad:
        out.sum().backward()
        assert all(t.grad is None or t.grad.dtype == t.dtype for t in (h, f))


def test_numpy_array_on_the_left_returns_a_tensor():
    x = mt.Tensor(np.ones(2, dtype=np.float32))
    assert isinstance(np.ones(2) * x, mt.Tensor)


def test_custom_function(float64):
    class Cube(mt.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a ** 3

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return 3 * a * a * g
    x = mt.Tensor([2.0], requires_grad=True)
    Cube.apply(x).sum().backward()
    assert x.grad[0] == 12.0


def test_only_floating_tensors_can_require_grad():
    with pytest.raises(TypeError):
        mt.Tensor(np.array([1, 2]), requires_grad=True)


def test_requires_grad_underscore_freezes_as_pytorch(float64):
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    assert model[0].requires_grad_(False) is model[0]
    model(mt.Tensor(np.ones((4, 3)))).sum().backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert model[1].weight.grad is not None
    x = mt.Tensor(np.ones(2)).requires_grad_()
    assert x.requires_grad and x.is_leaf
    with pytest.raises(RuntimeError, match="only a leaf's flag can change"):
        (x * 2).requires_grad_(False)
    with pytest.raises(TypeError, match="only floating tensors can require grad"):
        mt.Tensor(np.arange(3)).requires_grad_()
    # the attribute, as torch: a leaf's flag changes; a computed tensor's cannot (it would silently leave the graph)
    y = x * 2
    with pytest.raises(RuntimeError, match="only a leaf's flag can change"):
        y.requires_grad = False
    y.sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]
    x.requires_grad = False
    assert not (x * 2).requires_grad
    with pytest.raises(TypeError, match="only floating tensors can require grad"):
        mt.Tensor(np.arange(3)).requires_grad = True


def test_split_sizes_must_add_up():
    with pytest.raises(ValueError, match="add up"):
        mt.split(mt.Tensor(np.ones((2, 5))), [2, 2], axis=1)


def test_queued_callbacks_run_when_backward_ends(float64):
    from minitrain.autograd.engine import queue_callback
    order = []
    x = mt.Tensor(np.ones(2), requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda p: queue_callback(lambda: order.append(("end", p.grad.sum()))))
    (x * 2.0).sum().backward()
    assert order == [("end", 4.0)]
    with pytest.raises(RuntimeError, match="while backward"):
        queue_callback(lambda: None)


def test_a_grad_assigned_takes_the_tensor_s_shape():
    """PyTorch's "assigned grad has data of a different size": a (1,) gradient put on a (3,) parameter was kept, and
    every optimizer step then broadcast it over the whole parameter."""
    for t in (mt.Tensor(np.ones(3), requires_grad=True), nn.Parameter(np.ones(3))):
        with pytest.raises(ValueError, match=r"assigned grad has shape \(1,\), the tensor \(3,\)"):
            t.grad = np.ones(1)
        t.grad = np.full(3, 2.0)
        t.grad = None
        assert t.grad is None

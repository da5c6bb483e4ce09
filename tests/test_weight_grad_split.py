"""Backward split into B (input gradients) and W (weight gradients), the zero-bubble pipelines'
autograd piece: B then W equals one ordinary backward (float64, bit for bit or 1e-12), B computes
no weight gradient, W fires each weight's hooks once, and outside the block nothing changes."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.autograd import defer_weight_grads
from minitrain.autograd.checkpoint import checkpoint
from minitrain.nn import functional as F


def mlp():
    mt.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.GELU(), nn.Linear(7, 3))


def grads(model):
    return {n: None if q.grad is None else q.grad.copy() for n, q in model.named_parameters()}


def test_b_then_w_equals_one_backward(float64, rng):
    model = mlp()
    x = mt.Tensor(rng.standard_normal((4, 5)), requires_grad=True)
    g = rng.standard_normal((4, 3))
    model(x).backward(g)
    reference, x_reference = grads(model), x.grad.copy()
    model.zero_grad()
    x.grad = None
    out = model(x)
    with defer_weight_grads(model.parameters()) as w:
        out.backward(g)
    assert all(q.grad is None for q in model.parameters())      # B computed no weight gradient
    np.testing.assert_array_equal(x.grad, x_reference)           # ... but the whole input gradient
    assert len(w) == 3                                            # one queued node per Linear
    w.run()
    assert len(w) == 0
    for name, q in model.named_parameters():
        np.testing.assert_array_equal(q.grad, reference[name], err_msg=name)


def test_first_layer_with_a_plain_input_does_all_its_work_in_w(float64, rng):
    """x needs no gradient: B skips the first Linear entirely (its only gradient is the weights')."""
    model = mlp()
    x = mt.Tensor(rng.standard_normal((4, 5)))
    calls = []
    out = model(x)
    node = out._ctx
    while node.parents[0] is not None and not isinstance(node.parents[0], mt.Tensor):
        node = node.parents[0]                                    # walk back to the first Linear's node
    real = node.backward
    node.backward = lambda ctx, g: calls.append(ctx.needs_input_grad) or real(ctx, g)
    with defer_weight_grads(model.parameters()) as w:
        F.cross_entropy(out, np.array([0, 1, 2, 0])).backward()
    assert calls == []                                            # B never ran it
    w.run()
    assert calls == [(False, True, True)]                        # W: weight and bias only


def test_weight_used_twice_gets_the_sum_and_its_hooks_fire_once(float64, rng):
    lin = nn.Linear(4, 4)
    fired = []
    lin.weight.register_post_accumulate_grad_hook(lambda q: fired.append(q.grad.copy()))
    x = mt.Tensor(rng.standard_normal((3, 4)), requires_grad=True)
    F.linear(F.linear(x, lin.weight, lin.bias).tanh(), lin.weight, lin.bias).sum().backward()
    reference = lin.weight.grad.copy()
    lin.zero_grad()
    fired.clear()
    out = F.linear(F.linear(x, lin.weight, lin.bias).tanh(), lin.weight, lin.bias).sum()
    with defer_weight_grads(lin.parameters()) as w:
        out.backward()
    assert fired == [] and len(w) == 2
    w.run()
    assert len(fired) == 1
    np.testing.assert_allclose(lin.weight.grad, reference, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fired[0], reference, rtol=1e-12, atol=1e-14)


def test_saved_arrays_live_until_w_then_are_freed(float64, rng):
    model = mlp()
    from minitrain import memory
    out = model(mt.Tensor(rng.standard_normal((8, 5)), requires_grad=True))
    saved_after_forward = memory.snapshot()["activations"]
    with defer_weight_grads(model.parameters()) as w:
        out.backward(np.ones((8, 3)))
    kept = memory.snapshot()["activations"]
    assert 0 < kept < saved_after_forward                         # the Linears' inputs wait for W
    w.run()
    assert memory.snapshot()["activations"] == 0


def test_gpt_b_then_w_equals_backward_and_recomputation_nests(float64):
    """Every op of a GPT (matmul, layer norm, embedding, attention), with and without checkpointed
    blocks (a backward inside the backward): the split equals the plain backward."""
    for recompute in (None, "full"):
        mt.manual_seed(0)
        config = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, recompute=recompute)
        model = nn.GPT(config)
        idx = np.random.default_rng(0).integers(0, 11, (2, 6))
        _, loss = model(idx, idx)
        loss.backward()
        reference = grads(model)
        model.zero_grad()
        _, loss = model(idx, idx)
        with defer_weight_grads(model.parameters()) as w:
            loss.backward()
        assert all(q.grad is None for q in model.parameters())
        w.run()
        for name, value in reference.items():
            np.testing.assert_allclose(dict(model.named_parameters())[name].grad, value, rtol=1e-12, atol=1e-14,
                                       err_msg=f"{name} (recompute={recompute})")


def test_outside_the_block_backward_is_unchanged(float64, rng):
    model = mlp()
    x = mt.Tensor(rng.standard_normal((4, 5)))
    with defer_weight_grads(model.parameters()):
        pass
    out = model(x).sum()
    out.backward()
    assert all(q.grad is not None for q in model.parameters())
    with pytest.raises(RuntimeError, match="freed"):              # and frees the graph as before
        out.backward()


def test_checkpointed_segment_defers_its_weights_too(float64, rng):
    model = mlp()
    x = mt.Tensor(rng.standard_normal((4, 5)), requires_grad=True)
    checkpoint(model, x).sum().backward()
    reference = grads(model)
    model.zero_grad()
    out = checkpoint(model, x).sum()
    with defer_weight_grads(model.parameters()) as w:
        out.backward()
    assert all(q.grad is None for q in model.parameters()) and len(w) == 3
    w.run()
    for name, q in model.named_parameters():
        np.testing.assert_allclose(q.grad, reference[name], rtol=1e-12, atol=1e-14)

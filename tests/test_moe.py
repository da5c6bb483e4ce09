"""The mixture-of-experts layer (nn/moe.py, nn/moe_dispatch.py): against an independent dense PyTorch
reference in float64 (output, aux loss, every gradient, the dropped choices), central differences,
the dispatch plan and statistics on a hand-made routing, and a GPT with MoE blocks that trains."""
import math

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.nn.moe_dispatch import capacity, plan_dispatch
from minitrain.testing import gradcheck

TOL = dict(rtol=1e-10, atol=1e-10)


def torch_moe(torch, x, router, experts, k, capacity_factor, groups, alpha, normalize):
    """The reference, written densely: every expert on every token, each choice's output times its
    gate times whether it was kept; capacity by walking each group's choices in priority order."""
    TF = torch.nn.functional
    N, E = x.shape[0], router.shape[0]
    logits = x @ router.T
    probs = torch.softmax(logits, dim=-1)
    if normalize:                                                   # Mixtral: softmax of the top-k logits
        top, idx = logits.topk(k, dim=-1)
        gates = torch.softmax(top, dim=-1)
    else:                                                           # Switch / GShard: softmax, then top-k
        gates, idx = probs.topk(k, dim=-1)
    S = N // groups
    kept = np.ones((N, k), dtype=bool)
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * S * k / E)
        for g in range(groups):
            taken = [0] * E
            for j in range(k):
                for n in range(g * S, (g + 1) * S):
                    e = int(idx[n, j])
                    kept[n, j] = taken[e] < cap
                    taken[e] += kept[n, j]
    every = torch.stack([TF.linear(TF.gelu(TF.linear(x, w1, b1), approximate="tanh"), w2, b2)
                         for w1, b1, w2, b2 in experts])            # (E, N, C)
    weight = gates * torch.tensor(kept, dtype=x.dtype)
    out = sum(weight[:, j:j + 1] * every[idx[:, j], torch.arange(N)] for j in range(k))
    aux = 0.0
    for g in range(groups):
        rows = slice(g * S, (g + 1) * S)
        f = TF.one_hot(idx[rows], E).sum(dim=(0, 1)).to(x.dtype) / (S * k)
        aux = aux + alpha * E * (f * probs[rows].mean(dim=0)).sum()
    return out, aux / groups, kept


CASES = {   # top_k, capacity_factor, groups, normalize_gates
    "switch_top1_dropless": (1, None, 1, False),
    "top2_dropless": (2, None, 1, False),
    "switch_top1_capacity_groups": (1, 1.0, 2, False),
    "top2_capacity_groups": (2, 1.0, 3, False),
    "top2_tight_capacity": (2, 0.5, 2, False),
    "mixtral_top2_capacity": (2, 1.25, 2, True),
}


@pytest.mark.parametrize("case", CASES)
def test_moe_matches_a_dense_torch_reference(case, float64, rng):
    torch = pytest.importorskip("torch")
    k, cf, groups, normalize = CASES[case]
    E, C, B, T = 4, 6, 3, 8
    moe = nn.MoE(C, E, top_k=k, capacity_factor=cf, groups=groups, aux_loss_coef=0.1, normalize_gates=normalize)
    for p in moe.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    x_np = rng.standard_normal((B, T, C))
    x = mt.Tensor(x_np.copy(), requires_grad=True)
    leaves = {name: torch.tensor(p.data.copy(), requires_grad=True) for name, p in moe.named_parameters()}
    experts = [tuple(leaves[f"experts.{i}.{n}"] for n in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"))
               for i in range(E)]
    x_t = torch.tensor(x_np.reshape(-1, C), requires_grad=True)
    out_t, aux_t, kept = torch_moe(torch, x_t, leaves["router.weight"], experts, k, cf, groups, 0.1, normalize)
    if cf is not None:
        assert not kept.all(), "the case should drop some choices"

    out = moe(x)
    np.testing.assert_allclose(out.numpy().reshape(-1, C), out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(moe.aux_loss.numpy(), aux_t.detach().numpy(), **TOL)
    # the choices dropped are exactly the reference's, and the statistics count them
    choices = np.argsort(-(x_np.reshape(-1, C) @ moe.router.weight.data.T), axis=-1)[:, :k]
    plan = plan_dispatch(choices, E, moe.capacity(B * T), groups)
    assert sorted(plan.slot.tolist()) == np.flatnonzero(kept.reshape(-1)).tolist()
    assert moe.statistics()["tokens_dropped"] == int((~kept).sum())

    g = rng.standard_normal(out.shape)
    ((out * mt.Tensor(g)).sum() + moe.aux_loss).backward()
    ((out_t * torch.tensor(g.reshape(-1, C))).sum() + aux_t).backward()
    np.testing.assert_allclose(x.grad.reshape(-1, C), x_t.grad.numpy(), **TOL)
    for name, p in moe.named_parameters():
        assert leaves[name].grad is not None, name
        np.testing.assert_allclose(p.grad, leaves[name].grad.numpy(), err_msg=name, **TOL)


@pytest.mark.parametrize("k,cf", [(1, 1.0), (2, 1.0), (2, None)])
def test_moe_gradients_match_central_differences(k, cf, float64, rng):
    moe = nn.MoE(4, 3, top_k=k, capacity_factor=cf, groups=2, aux_loss_coef=0.5)
    x = mt.Tensor(rng.standard_normal((6, 4)), requires_grad=True)
    params = list(moe.parameters())

    def fn(x, *_):   # the parameters are perturbed in place by gradcheck
        return mt.cat([moe(x).reshape(-1), moe.aux_loss.reshape(1)])
    gradcheck(fn, [x] + params, atol=1e-7, rtol=1e-6)


def hand_made_choices():
    """8 tokens in 2 groups of 4, each token's (first, second) expert among 4."""
    return np.array([[0, 1], [0, 2], [0, 1], [1, 0],      # group 0
                     [2, 3], [3, 2], [2, 3], [2, 3]])     # group 1


def test_dispatch_plan_on_a_hand_made_routing():
    choices = hand_made_choices()
    cap = capacity(1.0, tokens_per_group=4, top_k=2, num_experts=4)
    assert cap == 2
    plan = plan_dispatch(choices, 4, cap, groups=2)
    # group 0: expert 0 takes the first choices of tokens 0, 1 (token 2's is over capacity), so token 3's
    # second choice is dropped too; expert 1 takes token 3's first and token 0's second choice.
    # group 1: expert 2 takes tokens 4, 6 (first choices); expert 3 token 5's first and token 4's second.
    kept = {(0, 0), (1, 0), (3, 0), (0, 1), (1, 1),
            (4, 0), (6, 0), (5, 0), (4, 1)}
    assert {(s // 2, s % 2) for s in plan.slot.tolist()} == kept
    assert plan.counts == [2, 2, 3, 2]
    # rows grouped by expert, then group, then priority order
    assert plan.token.tolist() == [0, 1, 3, 0, 1, 4, 6, 5, 4]
    assert plan.routed.tolist() == [[4, 3, 1, 0], [0, 0, 4, 4]]
    assert plan.dropped == 16 - 9
    dropless = plan_dispatch(choices, 4, None, groups=2)
    assert dropless.counts == [4, 3, 5, 4] and dropless.dropped == 0


def test_moe_statistics_on_a_hand_made_routing(float64):
    E, alpha = 4, 0.1
    moe = nn.MoE(E, E, top_k=2, capacity_factor=1.0, groups=2, aux_loss_coef=alpha)
    moe.router.weight.data[...] = np.eye(E)                 # the logits are the token itself
    x = np.zeros((8, E))
    for n, (a, b) in enumerate(hand_made_choices()):
        x[n, a], x[n, b] = 3.0, 1.0 + 0.1 * n
    moe(mt.Tensor(x))
    stats = moe.statistics()
    assert stats["load"] == [4, 3, 5, 4]
    assert stats["load_max_over_mean"] == 5 / 4
    assert stats["tokens_dropped"] == 7
    probs = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    f = np.array([[4, 3, 1, 0], [0, 0, 4, 4]]) / (4 * 2)        # each group's choices per expert / (S k)
    P = probs.reshape(2, 4, E).mean(axis=1)
    expected = np.mean([alpha * E * (f[g] * P[g]).sum() for g in range(2)])
    assert abs(stats["aux_loss"] - expected) < 1e-15


def test_aux_loss_is_alpha_when_balanced_and_alpha_times_e_when_collapsed(float64):
    moe = nn.MoE(4, 4, top_k=1, aux_loss_coef=0.01)
    moe.router.weight.data[...] = 0.0                      # uniform probabilities: P_i = 1 / E
    moe(mt.Tensor(np.ones((8, 4))))
    assert abs(moe.statistics()["aux_loss"] - 0.01) < 1e-15     # sum_i f_i / E · E = 1
    moe.router.weight.data[...] = 0.0
    moe.router.weight.data[2] = 100.0                      # every token to expert 2 with probability ~1
    moe(mt.Tensor(np.ones((8, 4))))
    assert abs(moe.statistics()["aux_loss"] - 0.04) < 1e-12


def test_single_expert_with_normalized_gate_is_the_mlp(float64, rng):
    moe = nn.MoE(6, 1, top_k=1, normalize_gates=True)
    x = mt.Tensor(rng.standard_normal((2, 5, 6)))
    np.testing.assert_array_equal(moe(x).numpy(), moe.experts[0](x).numpy())


def gpt_config(**moe):
    return nn.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16, **moe)


def test_gpt_with_moe_blocks_names_its_parameters_and_trains(float64, rng):
    model = nn.GPT(gpt_config(moe_experts=4, moe_top_k=2, moe_capacity_factor=1.5, moe_every=2))
    names = [n for n, _ in model.named_parameters()]
    assert "h.0.mlp.c_fc.weight" in names and not any(n.startswith("h.0.mlp.experts") for n in names)
    assert "h.1.mlp.router.weight" in names and "h.1.mlp.experts.3.c_fc.weight" in names
    assert "h.1.mlp.experts.0.c_proj.bias" in names and "h.1.mlp.c_fc.weight" not in names
    idx = rng.integers(0, 13, (4, 8))
    targets = np.roll(idx, -1, axis=1)
    # the training loss is the cross-entropy plus the MoE layer's aux loss; eval reports the cross-entropy
    model.eval()
    _, ce = model(idx, targets)
    model.train()
    _, loss = model(idx, targets)
    assert abs(loss.item() - ce.item() - model.h[1].mlp.aux_loss.item()) < 1e-14
    assert model.h[1].mlp.aux_loss.item() > 0
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.h[1].mlp.router.weight.grad is not None


def test_dense_gpt_is_unchanged_without_experts(float64):
    mt.manual_seed(3)
    dense = nn.GPT(gpt_config())
    mt.manual_seed(3)
    also = nn.GPT(gpt_config(moe_top_k=1, moe_every=5))      # moe fields without experts do nothing
    assert [n for n, _ in dense.named_parameters()] == [n for n, _ in also.named_parameters()]
    for (_, a), (_, b) in zip(dense.named_parameters(), also.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("make,message", [
    (lambda: nn.MoE(8, 4, top_k=5), "top_k"),
    (lambda: nn.MoE(8, 4, capacity_factor=0), "capacity_factor"),
    (lambda: nn.MoE(8, 4, groups=0), "groups"),
    (lambda: nn.MoE(8, 4, groups=3)(mt.Tensor(np.ones((2, 4, 8), dtype=np.float32))), "groups"),
    (lambda: gpt_config(moe_experts=4, moe_every=3), "moe_every"),
    (lambda: gpt_config(moe_experts=-1), "moe_experts"),
    (lambda: nn.GPT(gpt_config(moe_experts=4, moe_top_k=0)), "top_k"),
])
def test_bad_moe_settings_are_one_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_an_moe_gpt_step_on_the_gpu_reads_only_the_split_sizes_and_equals_the_cpu(standin_gpu, float64):
    """On the strict CuPy stand-in: no implicit copy; one synchronisation per MoE layer (its rows per
    expert, the split sizes) besides reading the loss; the same numbers as on the CPU."""
    from minitrain import backend
    config = gpt_config(moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_groups=2)
    idx = np.random.default_rng(0).integers(0, 13, (4, 8))

    def run(device):
        backend.set_device(device)
        mt.manual_seed(0)
        model = nn.GPT(config)
        opt = optim.AdamW(model.parameters(), lr=1e-2)

        def step():
            _, loss = model(idx, idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()
        step()
        with standin_gpu._standin.counting() as c:
            loss = step()
        return loss, c.delta, model.h[1].mlp.statistics()
    gpu_loss, delta, gpu_stats = run("cuda")
    cpu_loss, _, cpu_stats = run("cpu")
    backend.set_device("cuda")
    assert delta["h2d_implicit"] == 0 and delta["device_pointers"] == 0, delta
    assert delta["sync"] == 2 + 1 and delta["d2h"] == 2 + 1, delta
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-12)
    assert gpu_stats["load"] == cpu_stats["load"] and gpu_stats["tokens_dropped"] == cpu_stats["tokens_dropped"]

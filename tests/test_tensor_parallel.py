"""Tensor and sequence parallelism: Megatron's f and g, column/row-parallel linears, the
tensor-parallel GPT equal to the single-process GPT (forward, gradients, 3 AdamW steps; float64,
1e-10) at tp = 2 and 4 with and without sequence parallelism (a vocabulary not divisible by tp
included; with dropout, recomputation and tied embeddings too), Megatron's collective counts per
layer, saved activations per layer against the derivation, and clear errors."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.comm import ThreadWorld
from minitrain.parallel.tensor_parallel import (ColumnParallelLinear, CopyToTensorParallelRegion,
                                                ParallelDropout, ReduceFromTensorParallelRegion,
                                                RowParallelLinear, tensor_parallelize)

CONFIG = dict(vocab_size=23, block_size=16, n_layer=2, n_head=4, n_embd=16)   # 23: padded to 24


def gpt_and_init(**overrides):
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, **overrides})
    model = nn.GPT(config)
    return config, {k: v.copy() for k, v in model.state_dict().items()}


def data(steps=3, vocab=23, B=3, T=8):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))) for _ in range(steps)]


def test_f_and_g_are_conjugate():
    def fn(comm):
        x = mt.Tensor(np.full(3, float(comm.rank + 1)), requires_grad=True)
        y = CopyToTensorParallelRegion.apply(x, comm)          # f: identity forward
        (y * float(comm.rank + 1)).sum().backward()             # each rank's gradient differs
        grad_f = x.grad.copy()
        x.grad = None
        z = ReduceFromTensorParallelRegion.apply(x, comm)      # g: all-reduce forward
        (z * 2.0).sum().backward()
        return y.data, grad_f, z.data, x.grad
    for r, (y, grad_f, z, grad_g) in enumerate(ThreadWorld(3).run(fn)):
        assert np.all(y == r + 1) and np.all(grad_f == 1 + 2 + 3)     # f backward: all-reduce
        assert np.all(z == 6.0) and np.all(grad_g == 2.0)               # g backward: identity


@pytest.mark.parametrize("t", [2, 4])
def test_column_then_row_parallel_linear_equals_the_unsplit_pair(t):
    mt.set_default_dtype(np.float64)
    rng = np.random.default_rng(0)
    A, B, x = rng.standard_normal((8, 4)), rng.standard_normal((3, 8)), rng.standard_normal((5, 4))
    expected = np.maximum(x @ A.T, 0) @ B.T

    def fn(comm):
        col = ColumnParallelLinear(4, 8, comm, bias=False)
        row = RowParallelLinear(8, 3, comm, bias=False)
        n = 8 // comm.size
        col.weight.data = A[comm.rank * n:(comm.rank + 1) * n].copy()
        row.weight.data = B[:, comm.rank * n:(comm.rank + 1) * n].copy()
        xt = mt.Tensor(x, requires_grad=True)
        y = row(col(xt).relu())
        y.sum().backward()
        return y.data, xt.grad
    xt = mt.Tensor(x, requires_grad=True)
    ref = ((xt @ mt.Tensor(A.T)).relu() @ mt.Tensor(B.T))
    ref.sum().backward()
    for y, gx in ThreadWorld(t).run(fn):
        np.testing.assert_allclose(y, expected, rtol=1e-12)
        np.testing.assert_allclose(gx, xt.grad, rtol=1e-12)    # f all-reduced the partial gradients


def _train_tp(comm, config, init, sequence_parallel, steps=3):
    mt.set_default_dtype(np.float64)
    gpt = nn.GPT(config)
    gpt.load_state_dict(init)
    model = tensor_parallelize(gpt, comm, sequence_parallel=sequence_parallel)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    mt.manual_seed(7)                                            # the dropout masks' stream
    first_logits = None
    losses = []
    for x, y in data(steps):
        if first_logits is None:
            with mt.no_grad():
                first_logits = model(x).data                      # gathered over the vocabulary
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.full_state_dict(), losses, first_logits


def _train_reference(config, init, steps=3):
    reference = nn.GPT(config)
    reference.load_state_dict(init)
    opt = optim.AdamW(reference.parameters(), lr=1e-2)
    mt.manual_seed(7)
    losses, first_logits = [], None
    for x, y in data(steps):
        if first_logits is None:
            with mt.no_grad():
                first_logits = reference(x).data
        opt.zero_grad()
        _, loss = reference(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return reference, losses, first_logits


FEATURES = {"plain": {}, "dropout": dict(dropout=0.2), "dropout+full": dict(dropout=0.2, recompute="full"),
            "dropout+selective": dict(dropout=0.2, recompute="selective"), "tied": dict(tie_weights=True)}


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_gpt_equals_the_gpt(t, sequence_parallel, features):
    """Dropout included: replicated regions draw the same mask on every rank, split regions (heads;
    with SP the sequence) each keep their slice of the whole tensor's mask, so the masks are one
    process's; recomputation replays them."""
    config, init = gpt_and_init(**FEATURES[features])
    reference, ref_losses, ref_logits = _train_reference(config, init)
    if config.dropout:          # the masks matter: without them the losses differ
        assert not np.allclose(ref_losses, _train_reference(gpt_and_init()[0], init)[1], rtol=1e-3)
    for state, losses, logits in ThreadWorld(t).run(_train_tp, config, init, sequence_parallel):
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        assert set(state) == set(init)
        for name, value in reference.state_dict().items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-10, err_msg=name)


def _one_step_counts(comm, config, init, sequence_parallel):
    gpt = nn.GPT(config)
    gpt.load_state_dict(init)
    model = tensor_parallelize(gpt, comm, sequence_parallel=sequence_parallel)
    x, y = data(1)[0]
    comm.stats.reset()
    _, loss = model(x, y)
    forward = {k: dict(v) for k, v in comm.stats.by_name.items()}
    comm.stats.reset()
    loss.backward()
    backward = {k: dict(v) for k, v in comm.stats.by_name.items()}
    return forward, backward


@pytest.mark.parametrize("t", [2, 4])
def test_megatron_counts_two_all_reduces_forward_and_two_backward_per_layer(t):
    """Per transformer layer (the difference between 2 layers and 1): TP 2 + 2 all-reduces of
    (B, T, C); SP the same bytes as 2 + 2 (reduce-scatter + all-gather) pairs, plus in backward the
    two re-gathers of the saved sequence shards (Korthikanti et al. sec. 4.2.2)."""
    per_layer = {}
    for sp in (False, True):
        counts = []
        for layers in (1, 2):
            config, init = gpt_and_init(n_layer=layers)
            counts.append(ThreadWorld(t).run(_one_step_counts, config, init, sp)[0])
        per_layer[sp] = [{k: {s: two[k][s] - one.get(k, {}).get(s, 0) for s in ("calls", "bytes_sent")}
                          for k in two} for one, two in zip(counts[0], counts[1])]
    B, T, C = 3, 8, 16
    all_reduce_bytes = 2 * (t - 1) * (B * T * C // t) * 8                 # ring: 2(p-1)/p·N·8
    for direction in (0, 1):                                              # forward, backward
        tp = per_layer[False][direction]
        assert tp["ring_all_reduce"] == {"calls": 2, "bytes_sent": 2 * all_reduce_bytes}
        assert {k for k, v in tp.items() if v["calls"]} == {"ring_all_reduce"}
        sp = per_layer[True][direction]
        # backward re-gathers each column-parallel layer's input (only the shard was saved): +2 all-gathers
        gathers = 2 if direction == 0 else 4
        assert sp["ring_all_gather"]["calls"] == gathers and sp["ring_reduce_scatter"]["calls"] == 2
        assert sp["ring_all_gather"]["bytes_sent"] + sp["ring_reduce_scatter"]["bytes_sent"] == \
            2 * all_reduce_bytes + (gathers - 2) * all_reduce_bytes // 2
        # (SP adds one all-reduce per step, not per layer: the LayerNorm / bias gradients, which each
        # rank computed from its slice of the sequence, summed in one flat buffer)
        assert sp.get("ring_all_reduce", {"calls": 0})["calls"] == 0


def test_shapes_that_do_not_divide_are_clear_errors():
    config, init = gpt_and_init(n_head=3, n_embd=12)

    def fn(comm):
        gpt = nn.GPT(config)
        gpt.load_state_dict(init)
        tensor_parallelize(gpt, comm)
    with pytest.raises(ValueError, match="n_head = 3 is not divisible by tp = 2"):
        ThreadWorld(2).run(fn)
    config, init = gpt_and_init()

    def odd_sequence(comm):
        gpt = nn.GPT(config)
        gpt.load_state_dict(init)
        model = tensor_parallelize(gpt, comm, sequence_parallel=True)
        model(np.zeros((2, 7), np.int64), np.zeros((2, 7), np.int64))
    with pytest.raises(ValueError, match="sequence length .* = 7 is not divisible by tp = 2"):
        ThreadWorld(2).run(odd_sequence)
    with pytest.raises(ValueError, match="dropout probability must be in"):
        ThreadWorld(2).run(lambda comm: ParallelDropout(1.0, comm, axis=1))


@pytest.mark.parametrize("t", [1, 2, 3])
def test_the_ranks_dropout_masks_put_together_are_one_process_mask(t):
    """A (2, 3t, 5) tensor split along axis 1: each rank's mask is its slice of the mask one process
    draws for the whole tensor from the same seed."""
    mt.set_default_dtype(np.float64)
    full = np.ones((2, 3 * t, 5))
    mt.manual_seed(3)
    expected = nn.Dropout(0.5)(mt.Tensor(full)).data

    def fn(comm):
        mt.manual_seed(3)
        local = full[:, comm.rank * 3:(comm.rank + 1) * 3]
        return ParallelDropout(0.5, comm, axis=1)(mt.Tensor(local)).data
    masks = ThreadWorld(t).run(fn)
    np.testing.assert_array_equal(np.concatenate(masks, axis=1), expected)
    assert 0 < (expected == 0).sum() < expected.size


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_clipping_uses_the_norm_of_the_full_gradient(sequence_parallel):
    config, init = gpt_and_init()
    reference = nn.GPT(config)
    reference.load_state_dict(init)
    x, y = data(1)[0]
    reference(x, y)[1].backward()
    expected = optim.clip_grad_norm_(reference.parameters(), 0.01)

    def fn(comm):
        gpt = nn.GPT(config)
        gpt.load_state_dict(init)
        model = tensor_parallelize(gpt, comm, sequence_parallel=sequence_parallel)
        model(x, y)[1].backward()
        return model.clip_grad_norm_(0.01)
    assert ThreadWorld(2).run(fn) == pytest.approx([expected] * 2, rel=1e-12)


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("t, sequence_parallel", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_saved_activations_per_layer_match_the_derivation(t, sequence_parallel, recompute):
    """The module docstring's count: TP sbh(4 + 16/t) + as²b/t + 2sb, SP (sbh·20 + as²b + 2sb)/t
    elements per layer and rank (the difference between a 2-layer and a 1-layer model's forward).
    Selective recomputation drops the as²b/t of the attention core; full keeps only each block's
    input: sbh, with SP sbh/t (Korthikanti et al. sec. 5)."""
    from minitrain import memory
    B, T, C, H = 2, 8, 16, 4
    saved = []
    for layers in (1, 2):
        config, init = gpt_and_init(n_layer=layers, vocab_size=24, block_size=T, n_head=H, n_embd=C,
                                    recompute=recompute)

        def fn(comm):
            gpt = nn.GPT(config)
            gpt.load_state_dict(init)
            model = tensor_parallelize(gpt, comm, sequence_parallel=sequence_parallel)
            x = np.random.default_rng(0).integers(0, 24, (B, T))
            before = memory.snapshot()["activations"]
            _, loss = model(x, x)                       # keep the graph (and what it saved) alive
            return memory.snapshot()["activations"] - before
        saved.append(ThreadWorld(t).run(fn))
    sbh, attention = B * T * C, H * T * T * B / t
    if recompute == "selective":
        attention = 0
    if recompute == "full":
        expected = 8 * sbh / (t if sequence_parallel else 1)
    elif sequence_parallel:
        expected = 8 * (sbh * 20 / t + attention + 2 * B * T / t)
    else:
        expected = 8 * (sbh * (4 + 16 / t) + attention + 2 * B * T)
    for one, two in zip(*saved):
        assert two - one == expected

"""Activation recomputation and offload: identical gradients, the sqrt(n) memory behaviour,
exactly one extra forward per recomputed segment, and offload moving what it restores."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import memory, nn
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import (DistributedDataParallel, checkpoint, checkpoint_sequential,
                                offload_activations)


def deep_mlp(n, width=64, dropout=0.0):
    """n layers of Linear + ReLU (+ Dropout), as a Sequential of n blocks."""
    blocks = []
    for _ in range(n):
        parts = [nn.Linear(width, width), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
        blocks.append(nn.Sequential(*parts))
    return nn.Sequential(*blocks)


def run(model, x, segments=None, offload=False, seed=3):
    """Peak saved activations, gradients and per-block forward counts of one forward + backward."""
    calls = [0] * len(model)
    for i, block in enumerate(model):
        block._forward_hooks.clear()
        block.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
    model.zero_grad()
    tracker = memory.MemoryTracker()
    with memory.use_tracker(tracker):
        mt.manual_seed(seed)
        if offload:
            with offload_activations() as moved:
                out = model(x)
        else:
            out = model(x) if segments is None else checkpoint_sequential(model, segments, x)
        out.sum().backward()
    grads = [p.grad.copy() for p in model.parameters()]
    return tracker.peak()["activations"], grads, calls, (moved if offload else None)


@pytest.fixture
def x():
    return mt.Tensor(np.random.default_rng(0).standard_normal((32, 64)))


def test_checkpoint_gives_bit_identical_gradients_with_dropout(float64, x):
    model = deep_mlp(6, dropout=0.3)
    _, plain, _, _ = run(model, x)
    _, recomputed, _, _ = run(model, x, segments=3)
    assert all(np.array_equal(a, b) for a, b in zip(plain, recomputed))


def test_16_layers_4_segments_keep_at_most_60_percent_of_the_activations(float64, x):
    model = deep_mlp(16)
    plain_peak, _, plain_calls, _ = run(model, x)
    peak, _, calls, _ = run(model, x, segments=4)
    assert peak <= 0.6 * plain_peak
    # exactly one extra forward of every block in the 3 recomputed segments, none in the last
    assert plain_calls == [1] * 16
    assert calls == [2] * 12 + [1] * 4


@pytest.mark.parametrize("n", [4, 16, 64])
def test_peak_memory_follows_sqrt_n(n, float64):
    """Exactly Chen et al.'s count. One activation a = batch x width x 8 bytes; a layer (Linear +
    ReLU) saves 2a (the Linear's input, the ReLU's output) and the loss's backward one more a.
    Plain: 2a·n + a. k segments: the k-1 checkpointed segment inputs (a each) + the last segment,
    live when backward starts, 2a·n/k + the loss's a: 2a·n/k + a·k, smallest near k = sqrt(2n);
    at k = sqrt(n), 3a·sqrt(n)."""
    model = deep_mlp(n, width=32)
    xs = mt.Tensor(np.random.default_rng(0).standard_normal((32, 32)))
    a = 32 * 32 * 8
    plain, _, _, _ = run(model, xs)
    assert plain == 2 * a * n + a
    for k in sorted({round(n ** 0.5), 2, n}):
        peak, _, _, _ = run(model, xs, segments=k)
        assert peak == 2 * a * (n // k) + a * k, (n, k, peak / a)
    assert run(model, xs, segments=round(n ** 0.5))[0] == 3 * a * round(n ** 0.5)


def test_parameters_get_gradients_when_the_input_needs_none(float64):
    layer = nn.Linear(4, 4)
    x = mt.Tensor(np.ones((2, 4)))                 # requires_grad=False
    checkpoint(layer, x).sum().backward()
    assert layer.weight.grad is not None and np.abs(layer.weight.grad).sum() > 0


def test_gpt_recompute_modes_give_identical_gradients_and_less_memory(float64):
    idx = np.random.default_rng(0).integers(0, 20, (4, 32))
    results = {}
    for mode in (None, "selective", "full"):
        tracker = memory.MemoryTracker()
        with memory.use_tracker(tracker):
            mt.manual_seed(0)
            gpt = nn.GPT(nn.GPTConfig(vocab_size=20, block_size=32, n_layer=3, n_head=4, n_embd=32,
                                      dropout=0.1, recompute=mode))
            mt.manual_seed(5)
            gpt(idx, idx)[1].backward()
            results[mode] = ([p.grad.copy() for p in gpt.parameters()], tracker.peak()["activations"])
    for mode in ("selective", "full"):
        assert all(np.array_equal(a, b) for a, b in zip(results[None][0], results[mode][0])), mode
    assert results["full"][1] < results["selective"][1] < results[None][1]


def test_offload_moves_activations_off_the_device_and_back(float64, x):
    model = deep_mlp(8, dropout=0.2)
    plain_peak, plain, _, _ = run(model, x)
    peak, grads, _, moved = run(model, x, offload=True)
    assert all(np.array_equal(a, b) for a, b in zip(plain, grads))
    assert peak < 0.1 * plain_peak                   # the device keeps none of them
    assert moved.bytes_offloaded == moved.bytes_restored > 0


def test_a_recomputation_inside_offload_keeps_what_it_saves_on_the_device(float64, x):
    """Backward run inside offload_activations (a pipeline's train_step does): the checkpointed segments'
    inputs go to the host, what their recomputation saves stays on the device for the backward that needs
    it at once (as PyTorch's checkpoint keeps it itself), counted by the ledger, never moved away and back."""
    tracker = memory.MemoryTracker()
    with memory.use_tracker(tracker):
        model = deep_mlp(6)                     # its parameters in this ledger: offload leaves them alone
        with offload_activations() as moved:
            out = checkpoint_sequential(model, 3, x)
            out.sum().backward()
    segment_inputs = 2 * x.data.nbytes          # the first two segments' inputs; the last runs plain
    last = 2 * 2 * x.data.nbytes                # its two blocks: Linear's input and ReLU's output each
    assert moved.bytes_offloaded == segment_inputs + last
    assert moved.bytes_restored == moved.bytes_offloaded
    # one segment recomputed at a time: its input (saved again by its first Linear), each ReLU's output (the
    # next Linear saves that same array)
    assert tracker.peak()["activations"] == 3 * x.data.nbytes


def test_ddp_with_recomputation_still_synchronises_once(float64):
    # a post-accumulate hook firing inside a checkpoint's inner backward must not end DDP's step early
    def fn(comm):
        mt.manual_seed(0)
        model = deep_mlp(6, width=8)
        reference = deep_mlp(6, width=8)
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.0)
        reference.load_state_dict(model.state_dict())
        xs = np.random.default_rng(1).standard_normal((8, 8))
        checkpoint_sequential(model, 3, mt.Tensor(xs[comm.rank::comm.size])).sum().backward()
        (reference(mt.Tensor(xs)).sum() * (1.0 / comm.size)).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        return comm.stats["ring_all_reduce"]["calls"], len(ddp.buckets)
    for calls, buckets in ThreadWorld(2).run(fn):
        assert calls == buckets


def test_fsdp_inside_offload_activations_still_offloads_them(float64):
    """FSDP's own saved-tensor hooks (a gathered unit's weights saved as references) sit inside the job's
    offload_activations and pass every other saved array on to it: the same activations leave the device as
    without FSDP, and come back for the backward."""
    from minitrain.parallel import FullyShardedDataParallel

    def fn(comm):
        out = []
        for wrap in (False, True):
            tracker = memory.MemoryTracker()              # (it knows the parameters: they are not offloaded)
            with memory.use_tracker(tracker):
                mt.manual_seed(0)
                model = deep_mlp(4, width=16)
                fsdp = FullyShardedDataParallel(model, comm) if wrap else None
                x = mt.Tensor(np.random.default_rng(comm.rank).standard_normal((4, 16)))
                with offload_activations() as moved:
                    loss = (fsdp or model)(x).sum()
                loss.backward()
            out.append((moved.bytes_offloaded, moved.bytes_restored, tracker.peak()["activations"]))
        return out
    for (plain_moved, _, _), (moved, restored, peak) in ThreadWorld(2).run(fn):
        assert moved == restored == plain_moved > 0        # every activation, none of the weights
        assert peak == 0                                   # the device keeps none of them


def test_checkpoint_output_keeps_the_dtype_its_function_gave():
    """The recipe's logits cast up to fp32 for the loss stay fp32 when the segment is checkpointed (the
    output took its first input's fp16 before)."""
    h = mt.Tensor(np.ones(3, np.float16), requires_grad=True)
    y = checkpoint(lambda x: (x * 2.0).float(), h)
    assert y.dtype == np.float32
    y.sum().backward()
    assert h.grad.dtype == np.float16
    np.testing.assert_array_equal(h.grad, 2.0)

"""minitrain on the GPU, checked on the strict CuPy stand-in in this process (fixture ``standin_gpu``):
the sync budget of a step per strategy, the fused kernels against the CPU ops, the API edges
(host data copied on purpose and counted, device data where host data belongs refused), and the
three crashes seen on the H100 (FSDP's pointer arithmetic, --offload, tensor parallelism).

Budget of one training step, per rank (stated; tested below): no implicit copy; host -> device
copies only for the batch (inputs and targets, at the API edge); synchronisations: 0 inside the
step (fp32 DDP, ZeRO-1/2/3, TP, TP+SP, pipeline), +1 for the inf/NaN check of fp16/bf16 mixed
precision, +1 when the training loop reads the loss (``loss.item()``), which these tests do.
Collectives run on ThreadWorld here (device-to-device copies); over MPI without CUDA-aware
transport every message is also staged through the host (the transport's synchronisations).
"""
import numpy as np
import pytest

import minitrain as mt
from minitrain import backend, nn, optim, random
from minitrain.autograd import ops
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import (CPUOffloadOptimizer, DistributedDataParallel, FullyShardedDataParallel,
                                ZeroRedundancyOptimizer)
from minitrain.parallel.tensor_parallel import tensor_parallelize
from minitrain.parallel.pipeline import PipelineParallel

pytestmark = pytest.mark.usefixtures("standin_gpu")


def batch(n=16, features=12, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)


def counted_step(cupy, step):
    """Run ``step()`` once to warm up (optimizer state, caches), then count the second one."""
    step()
    with cupy._standin.counting() as c:
        loss = step()
        loss_value = loss.item() if hasattr(loss, "item") else loss
    assert np.isfinite(loss_value)
    return c.delta


def assert_budget(delta, syncs, h2d=2):
    assert delta["h2d_implicit"] == 0 and delta["device_pointers"] == 0, delta
    assert delta["h2d"] == h2d, delta
    assert delta["sync"] == syncs and delta["d2h"] == syncs, delta


def mlp_step(comm, strategy, dtype=np.float32):
    model = nn.MLP([12, 16, 16, 5]).to(dtype)
    x, y = batch()
    rows = slice(comm.rank * 8, comm.rank * 8 + 8)
    if strategy == "ddp":
        wrapped = DistributedDataParallel(model, comm)
        opt = optim.Adam(model.parameters(), lr=1e-2) if dtype == np.float32 else \
            optim.MixedPrecisionOptimizer(model.parameters(), optim.Adam, lr=1e-2)
    elif strategy == "zero3":
        wrapped = FullyShardedDataParallel(model, comm)
        opt = optim.Adam(wrapped.parameters(), lr=1e-2)
    else:
        wrapped = model
        opt = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, comm, stage=int(strategy[-1]), lr=1e-2)

    def step():
        loss = F.cross_entropy(wrapped(mt.Tensor(x[rows]).to(dtype)).float(), y[rows])
        opt.zero_grad()
        (opt.scale(loss) if hasattr(opt, "scale") else loss).backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_data_parallel_step_makes_no_synchronisation_and_no_implicit_copy(standin_gpu, strategy):
    deltas = ThreadWorld(2).run(lambda comm: counted_step(standin_gpu, mlp_step(comm, strategy)))
    for delta in deltas:
        assert_budget(delta, syncs=1)          # the loss, read by the loop


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_mixed_precision_adds_one_synchronisation_for_its_overflow_check(standin_gpu, strategy):
    deltas = ThreadWorld(2).run(lambda comm: counted_step(standin_gpu, mlp_step(comm, strategy, backend.bfloat16)))
    for delta in deltas:
        assert_budget(delta, syncs=2)


def test_one_overflow_verdict_for_two_optimizers_is_one_synchronisation(standin_gpu):
    """ExpertZero's dense and experts' optimizers step on one verdict (found_inf(also=...)): their gradients'
    non-finite counts summed on the device, read back once; an inf in the second alone skips both."""
    dense, experts = nn.Linear(4, 4).to(np.float16), nn.Linear(4, 4).to(np.float16)
    opts = [optim.MixedPrecisionOptimizer(m.parameters(), optim.Adam, lr=1e-3) for m in (dense, experts)]
    for m in (dense, experts):
        m(mt.Tensor(np.ones((2, 4), np.float16))).float().sum().backward()
    with standin_gpu._standin.counting() as c:
        assert not opts[0].found_inf(also=opts[1:])
    assert c.delta["sync"] == 1, c.delta
    experts.weight.grad[0, 0] = np.inf
    assert opts[0].found_inf(also=opts[1:]) and not opts[0].found_inf()


def gpt_config(**kw):
    return nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, **kw)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_step_makes_no_synchronisation(standin_gpu, sequence_parallel):
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 11, (4, 8)), rng.integers(0, 11, (4, 8))

    def run(comm):
        mt.manual_seed(0)
        model = tensor_parallelize(nn.GPT(gpt_config(dropout=0.1)), comm, sequence_parallel=sequence_parallel)
        opt = optim.AdamW(model.parameters(), lr=1e-2)

        def step():
            _, loss = model(idx, targets)
            model.zero_grad()
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            return loss
        return counted_step(standin_gpu, step)
    for delta in ThreadWorld(2).run(run):
        assert_budget(delta, syncs=1)


def test_a_pipeline_step_reads_its_loss_once_on_the_last_stage(standin_gpu):
    x, y = batch()

    def run(comm):
        mt.manual_seed(0)
        pipe = PipelineParallel(nn.MLP([12, 16, 16, 5]), comm, "1f1b", num_microbatches=4)
        opt = optim.Adam(pipe.parameters(), lr=1e-2)

        def step():
            opt.zero_grad()
            loss = pipe.train_step(x, y, F.cross_entropy)
            opt.step()
            return loss
        return counted_step(standin_gpu, step)
    first, last = ThreadWorld(2).run(run)
    assert_budget(first, syncs=0, h2d=4)       # stage 0: the 4 micro-batches' inputs
    assert_budget(last, syncs=1, h2d=4)        # the last stage: 4 micro-batches' targets, the mean loss


def test_a_traced_pipeline_step_times_its_work_by_cuda_events_without_a_sync(standin_gpu):
    """Tracing adds no synchronisation to a step (events are recorded, not waited for); the measured
    bubble then reads the device's times: here each compute made to last 0.25 s on the 'device'."""
    from minitrain import trace
    x, y = batch()

    def run(comm):
        mt.manual_seed(0)
        pipe = PipelineParallel(nn.MLP([12, 16, 16, 5]), comm, "zb_h1", num_microbatches=4)
        opt = optim.Adam(pipe.parameters(), lr=1e-2)
        trace.enable(rank=comm.rank)

        def step():
            opt.zero_grad()
            loss = pipe.train_step(x, y, F.cross_entropy)
            opt.step()
            return loss
        delta = counted_step(standin_gpu, step)
        for times in pipe.stamps.device_records:
            for _, first, last in times:
                last._time = first._time + 0.25
        summary = pipe.measured_bubble()
        return delta, summary, len(pipe.stamps.device_records[-1])
    (first, s0, n0), (last, s1, n1) = ThreadWorld(2).run(run)
    assert_budget(first, syncs=0, h2d=4)
    assert_budget(last, syncs=1, h2d=4)
    assert n0 == n1 == 0                                    # resolved once, then dropped
    for summary in (s0, s1):
        for op in "FBW":
            assert summary["stage_seconds"][op] == pytest.approx([0.25, 0.25], abs=1e-9)


def test_adam_is_one_fused_kernel_per_parameter(standin_gpu):
    model = nn.MLP([12, 16, 5])
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    for q in model.parameters():
        q.grad = backend.xp().ones_like(q.data)
    opt.step()
    with standin_gpu._standin.counting() as c:
        opt.step()
    assert c.delta["kernels"] == c.delta["fused"] == len(list(model.parameters())), c.delta


# ---------------------------------------------------------------- fused kernels == the CPU ops
def both(fn, *arrays):
    """fn on float64 device tensors and on the CPU: (device results, CPU results), on the host."""
    results = []
    for device in ("cuda", "cpu"):
        backend.set_device(device)
        tensors = [mt.Tensor(a, requires_grad=True) if a.dtype.kind == "f" else a for a in arrays]
        out = fn(*tensors)
        out.backward(np.linspace(-1, 1, out.size).reshape(out.shape))
        results.append([out.numpy()] + [backend.to_host(t.grad) for t in tensors if isinstance(t, mt.Tensor)])
    backend.set_device("cuda")
    return results


@pytest.mark.parametrize("name, fn", [
    ("gelu", lambda x: F.gelu(x)),
    ("softmax", lambda x: F.softmax(x, axis=-1)),
    ("softmax axis 1", lambda x: F.softmax(x, axis=1)),
    ("softmax scaled and masked, a row masked whole",
     lambda x: F.softmax(x, axis=-1, scale=0.5, mask=(np.arange(20).reshape(4, 5) % 7 == 0) | (np.arange(4) == 2)[:, None])),
    ("log_softmax", lambda x: F.log_softmax(x, axis=-1)),
    ("layer_norm", lambda x: F.layer_norm(x, 5, mt.Tensor(np.linspace(0.5, 2, 5)), mt.Tensor(np.arange(5.0)))),
    ("layer_norm 2 axes, no affine", lambda x: F.layer_norm(x, (4, 5))),
])
def test_fused_kernels_equal_the_cpu_ops_forward_and_backward(name, fn):
    x = np.random.default_rng(1).standard_normal((3, 4, 5))
    gpu, cpu = both(fn, x)
    for g, c in zip(gpu, cpu):
        np.testing.assert_allclose(g, c, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("shape_a, shape_b", [((2, 3, 4, 5), (2, 3, 5, 6)), ((3, 4, 5), (1, 5, 6)), ((5,), (2, 5, 3))])
def test_a_batch_of_bfloat16_products_runs_in_float32_rounded_once(shape_a, shape_b):
    """CuPy has no batched bfloat16 GEMM (the stand-in refuses one as CuPy 14.2 does on an H200):
    attention's and the experts' products, forward and backward, go through float32."""
    bf16, f32 = backend.bfloat16, np.float32
    rng = np.random.default_rng(3)
    a16, b16 = (rng.standard_normal(shape).astype(bf16) for shape in (shape_a, shape_b))
    results = []
    for device, dtype in (("cuda", bf16), ("cpu", f32)):
        backend.set_device(device)
        a, b = mt.Tensor(a16.astype(dtype), requires_grad=True), mt.Tensor(b16.astype(dtype), requires_grad=True)
        out = a @ b
        out.backward(np.linspace(-1, 1, out.size).reshape(out.shape).astype(dtype))
        results.append([out.numpy(), backend.to_host(a.grad), backend.to_host(b.grad)])
    backend.set_device("cuda")
    (out, ga, gb), (want, want_ga, want_gb) = results
    assert out.dtype == bf16 and np.array_equal(out, want.astype(bf16))      # the float32 product, rounded once
    raw = backend.matmul(backend.to_device(a16), backend.to_device(b16))       # on arrays, as ring attention calls it
    assert raw.dtype == bf16 and np.array_equal(backend.to_host(raw), want.astype(bf16))
    for got, expected in ((ga, want_ga), (gb, want_gb)):
        assert got.dtype == bf16
        np.testing.assert_allclose(got.astype(f32), expected, rtol=2 ** -7, atol=2 ** -6)


def test_bfloat16_sorts_and_repeated_index_adds_on_the_gpu_run_in_float32():
    """CuPy sorts no bfloat16 and cupyx.scatter_add adds none (the stand-in refuses both, as CuPy 14.2 did
    on an H200): the experts' router sorts, an embedding's backward adds rows at repeated indices."""
    bf16, f32 = backend.bfloat16, np.float32
    scores = np.array([[0.5, -1.0, 2.0, 0.25], [3.0, 1.0, -2.0, 0.0]]).astype(bf16)
    order = backend.argsort(backend.to_device(scores), axis=-1)
    assert np.array_equal(backend.to_host(order), np.argsort(scores.astype(f32), axis=-1))
    indices = np.array([[0, 2, 0], [1, 0, 2]])                   # row 0 three times
    upstream = (np.linspace(-1, 1, 24).reshape(2, 3, 4) + 1 / 3).astype(bf16)
    weight = mt.Tensor(np.full((3, 4), 0.5, bf16), requires_grad=True)
    F.embedding(indices, weight).backward(upstream)
    sums = np.zeros((3, 4), f32)
    np.add.at(sums, indices.reshape(-1), upstream.reshape(-1, 4).astype(f32))
    assert weight.grad.dtype == bf16
    assert np.array_equal(backend.to_host(weight.grad), sums.astype(bf16))  # added in float32, rounded once


def test_cross_entropy_on_the_gpu_equals_the_cpu_and_copies_host_targets_on_purpose():
    rng = np.random.default_rng(2)
    logits, targets = rng.standard_normal((6, 7)), rng.integers(0, 7, 6)
    before = backend.transfer_counts()["h2d"]
    gpu, cpu = both(lambda z: F.cross_entropy(z, targets), logits)
    for g, c in zip(gpu, cpu):
        np.testing.assert_allclose(g, c, rtol=1e-12)
    assert backend.transfer_counts()["h2d"] - before == 3      # logits, upstream grad, targets (device run)


def test_bad_targets_on_the_gpu_give_nan_without_a_sync_and_an_index_error_when_validated(standin_gpu):
    logits = mt.Tensor(np.zeros((3, 4)), requires_grad=True)
    bad = backend.to_device(np.array([0, 4, 1]))
    with standin_gpu._standin.counting() as c:
        loss = F.cross_entropy(logits, bad)
    assert c.delta["sync"] == 0
    assert np.isnan(loss.item())
    with pytest.raises(IndexError, match=r"\[0, 4\), found 0\.\.4"):
        F.cross_entropy(logits, bad, validate_targets=True)
    good = backend.to_device(np.array([0, 3, 1]))
    with standin_gpu._standin.counting() as c:                      # validating costs one synchronisation
        loss = F.cross_entropy(logits, good, validate_targets=True)
    assert c.delta["sync"] == 1 and np.isfinite(loss.item())
    for validate in (False, True):                                  # host targets: always checked, before the copy
        with pytest.raises(IndexError, match="found -1..2"):
            F.cross_entropy(logits, np.array([0, -1, 2]), validate_targets=validate)


def test_device_integers_with_host_weights_are_refused_naming_the_argument():
    targets = backend.to_device(np.array([0, 1]))
    backend.set_device("cpu")
    with pytest.raises(TypeError, match=r"cross_entropy: targets are on the GPU .*backend.to_host\(targets\)"):
        F.cross_entropy(mt.Tensor(np.zeros((2, 3))), targets)
    with pytest.raises(TypeError, match=r"embedding: indices are on the GPU"):
        F.embedding(targets, mt.Tensor(np.zeros((3, 2))))
    backend.set_device("cuda")


def test_dropout_masks_are_drawn_on_the_device_replay_and_agree_across_tensor_parallel_slices(standin_gpu):
    x = mt.Tensor(np.ones((4, 6), np.float32))
    state = random.get_state()
    with standin_gpu._standin.counting() as c:
        a = F.dropout(x, 0.5).numpy()
    assert c.delta["h2d"] == 0                       # no mask came from the host
    random.set_state(state)
    leaf = mt.Tensor(np.ones((4, 6), np.float32), requires_grad=True)
    out = F.dropout(leaf, 0.5)
    out.sum().backward()
    full = out.numpy()
    np.testing.assert_array_equal(a, full)           # recomputation replays it
    np.testing.assert_array_equal(backend.to_host(leaf.grad), full)      # d(x·mask/(1-p))/dx = mask/(1-p)
    assert set(np.unique(a)) <= {0.0, 2.0} and 0 < (a == 0).sum() < a.size
    random.set_state(state)
    half = ops.Dropout.apply(mt.Tensor(np.ones((4, 3), np.float32)), 0.5, full_shape=(4, 6),
                             index=(slice(None), slice(3, 6))).numpy()
    np.testing.assert_array_equal(half, full[:, 3:])


def test_gpt_steps_on_the_gpu_equal_the_cpu_in_float64(float64):
    def run(device):
        backend.set_device(device)
        mt.manual_seed(0)
        model = nn.GPT(gpt_config(tie_weights=True))
        opt = optim.AdamW(model.parameters(), lr=1e-2)
        rng = np.random.default_rng(0)
        for _ in range(3):
            idx = rng.integers(0, 11, (2, 8))
            _, loss = model(idx, idx)
            opt.zero_grad()
            loss.backward()
            optim.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
        return {k: backend.to_host(v) for k, v in model.state_dict().items()}, loss.item()
    gpu, gpu_loss = run("cuda")
    cpu, cpu_loss = run("cpu")
    backend.set_device("cuda")
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-12)
    for name in cpu:
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_load_state_dict_and_backward_take_host_arrays_on_purpose():
    model = nn.Linear(3, 2)
    host = {k: np.full(v.shape, 0.5, np.float32) for k, v in model.state_dict().items()}
    before = backend.transfer_counts()["h2d"]
    model.load_state_dict(host)
    assert backend.transfer_counts()["h2d"] - before == 2
    out = model(mt.Tensor(np.ones((4, 3), np.float32)))
    out.backward(np.ones((4, 2), np.float32))                 # a host gradient for a device output
    np.testing.assert_allclose(backend.to_host(model.weight.grad), np.full((2, 3), 4.0))


# ---------------------------------------------------------------- the crashes seen on the H100
def test_fsdp_on_the_gpu_finds_its_views_without_host_pointers_and_matches_the_cpu():
    x, y = batch()

    def run(comm, device):
        backend.set_device(device)
        mt.manual_seed(0)
        model = FullyShardedDataParallel(nn.MLP([12, 16, 16, 5]), comm)
        opt = optim.SGD(model.parameters(), lr=0.1)
        rows = slice(comm.rank * 8, comm.rank * 8 + 8)
        for _ in range(2):
            loss = F.cross_entropy(model(mt.Tensor(x[rows])), y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {k: backend.to_host(v) for k, v in model.full_state_dict().items()}
    gpu = ThreadWorld(2).run(run, "cuda")[0]
    cpu = ThreadWorld(2).run(run, "cpu")[0]
    backend.set_device("cuda")
    for name in cpu:
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_offload_keeps_masters_and_state_on_the_host_and_copies_gradients_on_purpose():
    model = nn.MLP([12, 16, 5])
    opt = CPUOffloadOptimizer(model.parameters(), optim.Adam, lr=1e-2)
    x, y = batch()
    loss = F.cross_entropy(model(mt.Tensor(x)), y)
    opt.zero_grad()
    loss.backward()
    before = backend.transfer_counts()
    opt.step()
    after = backend.transfer_counts()
    params = list(model.parameters())
    assert all(not backend.is_device_array(m.data) for m in opt.masters)
    assert all(not backend.is_device_array(s) for st in opt.optimizer.state.values() for s in st.values()
               if hasattr(s, "shape"))
    # per parameter: its gradient down, its new value up; plus the overflow flag (one synchronisation)
    assert after["d2h"] - before["d2h"] == len(params) + 1 and after["h2d"] - before["h2d"] == len(params)
    assert all(backend.is_device_array(q.data) for q in params)


def test_tensor_parallel_gpt_takes_host_tokens_and_matches_the_gpt(float64):
    rng = np.random.default_rng(3)
    idx, targets = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
    mt.manual_seed(0)
    _, want = nn.GPT(gpt_config())(idx, targets)

    def run(comm):
        mt.manual_seed(0)
        return tensor_parallelize(nn.GPT(gpt_config()), comm)(idx, targets)[1].item()
    for got in ThreadWorld(2).run(run):
        assert got == pytest.approx(want.item(), rel=1e-12)


def test_trace_spans_are_timed_by_device_events_and_read_back_once(standin_gpu):
    from minitrain import trace
    tracer = trace.Tracer(rank=0)
    trace.set_tracer(tracer)
    trace.enable(rank=0)
    x = mt.Tensor(np.ones((64, 64), np.float32))
    with standin_gpu._standin.counting() as during:
        for _ in range(3):
            with trace.span("matmul"):
                (x @ x).sum()
    events = trace.events()
    trace.disable()
    trace.set_tracer(trace._default)
    assert during.delta["sync"] == 0                           # recording events never waits
    assert len(events) == 3 and all("host_start" in e["args"] and "_cuda" not in e for e in events)
    assert all(e["end"] >= e["start"] for e in events) and events[1]["start"] >= events[0]["end"]


def test_a_host_mask_meets_device_scores_by_a_counted_copy_and_a_device_mask_host_scores_is_refused():
    mask = np.eye(3, dtype=bool)
    before = backend.transfer_counts()["h2d"]
    out = F.softmax(mt.Tensor(backend.to_device(np.zeros((3, 3)))), mask=mask)
    assert backend.transfer_counts()["h2d"] - before == 2                # the scores, then the mask
    np.testing.assert_allclose(out.numpy(), np.where(mask, 0, 0.5))
    on_gpu = backend.to_device(mask)
    backend.set_device("cpu")
    with pytest.raises(TypeError, match=r"softmax: mask is on the GPU but the weights on the host"):
        F.softmax(mt.Tensor(np.zeros((3, 3))), mask=on_gpu)
    backend.set_device("cuda")

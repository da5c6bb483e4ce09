"""ZeRO stages 1-2 against single-process training on the global batch (float64, 1e-10) at
p = 1..4, with SGD and Adam, a parameter count not divisible by p, a frozen layer, tied weights,
and clipping by the norm of the full gradient; model-state bytes and bytes sent equal the formulas."""
import math

import numpy as np
import pytest

import minitrain as mt
from minitrain import memory, nn, optim
from minitrain.comm import DeviceMesh, ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import ZeroRedundancyOptimizer
from minitrain.parallel.clip import clip_sharded_grad_norm_, sum_of_squares
from test_ddp import Toy, assert_same, batches


def run_zero(comm, stage, opt_class, kwargs, steps=3, clip=None, bucket_cap_mb=0.001):
    mt.set_default_dtype(np.float64)
    mt.manual_seed(comm.rank)                       # different inits: ZeRO broadcasts rank 0's
    model = Toy()
    zero = ZeroRedundancyOptimizer(model.parameters(), opt_class, comm, stage=stage,
                                   bucket_cap_mb=bucket_cap_mb, **kwargs)
    reference = Toy()
    reference.load_state_dict(model.state_dict())
    ref_opt = opt_class([q for q in reference.parameters() if q.requires_grad], **kwargs)
    p, r = comm.size, comm.rank
    for step, (x, y) in enumerate(batches(steps, 4 * p * 2)):
        # "sometimes" stays unused: a flat shard optimizer cannot skip part of its shard, so a parameter
        # that had a gradient and then has none gets a zero gradient (momentum still moves it), where
        # one process skips it (DeepSpeed behaves the same; documented in zero.py)
        sometimes = False
        ref_opt.zero_grad()
        F.cross_entropy(reference(mt.Tensor(x), sometimes), y).backward()
        zero.zero_grad()
        F.cross_entropy(model(mt.Tensor(x[r::p]), sometimes), y[r::p]).backward()
        if clip is not None:
            ref_norm = optim.clip_grad_norm_(reference.parameters(), clip)
            norm = zero.clip_grad_norm_(clip)
            assert norm == pytest.approx(ref_norm, rel=1e-12)
        ref_opt.step()
        zero.step()
        assert_same(model, reference, f"rank {r} stage {stage} step {step}")


SGD = (optim.SGD, dict(lr=0.1, momentum=0.9))
ADAM = (optim.Adam, dict(lr=0.01))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
def test_zero_equals_single_process(p, stage, opt, float64):
    ThreadWorld(p).run(run_zero, stage, *opt)


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_uses_the_norm_of_the_full_gradient(stage, float64):
    ThreadWorld(3).run(run_zero, stage, *ADAM, 2, 0.05)


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_sharded_clipping_equals_clipping_the_whole_gradient_in_one_process(loss_scale, float64):
    """parallel/clip.py, the one sharded clipping ZeRO and tensor x pipeline parallelism share: a
    gradient cut over a 2 x 2 mesh (summed over "tp", then "pp") and scaled by the loss scale S."""
    whole = np.random.default_rng(0).standard_normal(40) * 0.1

    def fn(comm):
        mesh = DeviceMesh(comm, pp=2, tp=2)
        q = nn.Parameter(np.zeros(10))
        q.grad = whole[comm.rank * 10:(comm.rank + 1) * 10] * loss_scale
        norm = clip_sharded_grad_norm_([q], 0.05, sum_of_squares([q.grad]), [mesh.comm("tp"), mesh.comm("pp")],
                                       loss_scale=loss_scale)
        return norm, q.grad / loss_scale
    reference = nn.Parameter(np.zeros(40))
    reference.grad = whole.copy()
    want = optim.clip_grad_norm_([reference], 0.05)
    results = ThreadWorld(4).run(fn)
    assert all(norm == pytest.approx(want, rel=1e-12) for norm, _ in results)
    np.testing.assert_allclose(np.concatenate([g for _, g in results]), reference.grad, rtol=1e-12)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("p", [3, 4])
def test_model_state_bytes_and_traffic_equal_the_zero_formulas(stage, p):
    def fn(comm):
        tracker = memory.MemoryTracker()
        with memory.use_tracker(tracker):
            mt.manual_seed(0)
            model = nn.MLP([30, 41, 7])            # Ψ = 1558 float32 parameters, not divisible by 4
            psi = model.num_parameters()
            zero = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, comm, stage=stage)
            x = np.random.default_rng(comm.rank).standard_normal((8, 30)).astype(np.float32)
            comm.stats.reset()          # stage 2 reduce-scatters during backward: count from here
            zero.zero_grad()
            F.cross_entropy(model(mt.Tensor(x)), np.zeros(8, np.int64)).backward()
            zero.step()
            sent = comm.stats.bytes_sent
            live = dict(tracker.live)
        return psi, live, sent
    for psi, live, sent in ThreadWorld(p).run(fn):
        padded = math.ceil(psi / p) * p
        shard = padded // p
        assert live["params"] == 4 * padded                                   # 4Ψ (+ padding)
        assert live["optimizer_state"] == 8 * shard                           # 8Ψ/N
        assert live["grads"] == (4 * padded if stage == 1 else 4 * shard)     # 4Ψ, or 4Ψ/N
        assert 0 < padded - psi < p                                           # 1558 is padded at p = 4 and 3
        assert sent == 2 * (p - 1) * shard * 4       # reduce-scatter + all-gather: 2(p-1)/p·Ψ_pad·4 bytes


@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_per_step_are_two_psi(stage):
    p = 3

    def fn(comm):
        mt.manual_seed(0)
        model = nn.MLP([30, 41, 7])
        zero = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, comm, stage=stage, lr=0.1,
                                       bucket_cap_mb=0.001)
        comm.stats.reset()
        zero.zero_grad()
        x = np.random.default_rng(comm.rank).standard_normal((6, 30)).astype(np.float32)
        F.cross_entropy(model(mt.Tensor(x)), np.zeros(6, np.int64)).backward()
        zero.step()
        return model.num_parameters(), comm.stats["ring_reduce_scatter"]["bytes_sent"], \
            comm.stats["ring_all_gather"]["bytes_sent"]
    for psi, rs, ag in ThreadWorld(p).run(fn):
        shard = math.ceil(psi / p)
        assert rs == ag == (p - 1) * shard * 4          # (p-1)/p·Ψ_pad each: 2Ψ in all, as DDP


# ---------------------------------------------------------------- stage 3: FullyShardedDataParallel
from minitrain.parallel import FullyShardedDataParallel  # noqa: E402


def run_fsdp(comm, opt_class, kwargs, steps=3, model_fn=None, clip=None):
    mt.set_default_dtype(np.float64)
    mt.manual_seed(comm.rank)
    model = (model_fn or (lambda: nn.MLP([6, 13, 11, 3])))()
    reference = (model_fn or (lambda: nn.MLP([6, 13, 11, 3])))()
    fsdp = FullyShardedDataParallel(model, comm)
    reference.load_state_dict(fsdp.full_state_dict())
    opt, ref_opt = opt_class(fsdp.parameters(), **kwargs), opt_class(reference.parameters(), **kwargs)
    p, r = comm.size, comm.rank
    for step, (x, y) in enumerate(batches(steps, 4 * p * 2)):
        ref_opt.zero_grad()
        F.cross_entropy(reference(mt.Tensor(x)), y).backward()
        opt.zero_grad()
        F.cross_entropy(fsdp(mt.Tensor(x[r::p])), y[r::p]).backward()
        if clip is not None:
            assert fsdp.clip_grad_norm_(clip) == pytest.approx(optim.clip_grad_norm_(reference.parameters(), clip),
                                                               rel=1e-12)
        ref_opt.step()
        opt.step()
        full = fsdp.full_state_dict()
        for name, q in reference.named_parameters():
            np.testing.assert_allclose(full[name], q.data, rtol=1e-10, atol=1e-10, err_msg=f"rank {r} step {step} {name}")


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
def test_fsdp_equals_single_process(p, opt, float64):
    ThreadWorld(p).run(run_fsdp, *opt)


def test_fsdp_clips_by_the_norm_of_the_whole_gradient(float64):
    ThreadWorld(3).run(run_fsdp, *ADAM, 2, None, 0.05)


def test_fsdp_on_the_gpt_equals_single_process(float64):
    def gpt():
        return nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8))

    def fn(comm):
        mt.set_default_dtype(np.float64)
        mt.manual_seed(comm.rank)
        model, reference = gpt(), gpt()
        fsdp = FullyShardedDataParallel(model, comm)
        reference.load_state_dict(fsdp.full_state_dict())
        opt, ref_opt = optim.AdamW(fsdp.parameters(), lr=1e-2), optim.AdamW(reference.parameters(), lr=1e-2)
        idx = np.random.default_rng(0).integers(0, 11, (4 * comm.size, 8))
        for _ in range(2):
            ref_opt.zero_grad(); reference(idx, idx)[1].backward(); ref_opt.step()
            opt.zero_grad(); fsdp(idx[comm.rank::comm.size], idx[comm.rank::comm.size])[1].backward(); opt.step()
        full = fsdp.full_state_dict()
        for name, q in reference.named_parameters():
            np.testing.assert_allclose(full[name], q.data, rtol=1e-10, atol=1e-10, err_msg=name)
    ThreadWorld(3).run(fn)


@pytest.mark.parametrize("p", [2, 4])
def test_fsdp_model_states_are_16_psi_over_n_and_traffic_3_psi(p):
    def fn(comm):
        tracker = memory.MemoryTracker()
        with memory.use_tracker(tracker):
            mt.manual_seed(0)
            model = nn.MLP([30, 41, 41, 7])
            psi = model.num_parameters()
            fsdp = FullyShardedDataParallel(model, comm)
            opt = optim.Adam(fsdp.parameters())
            x = np.random.default_rng(comm.rank).standard_normal((8, 30)).astype(np.float32)
            comm.stats.reset()
            opt.zero_grad()
            F.cross_entropy(fsdp(mt.Tensor(x)), np.zeros(8, np.int64)).backward()
            opt.step()
            shards = sum(u.flat.shard_size for u in fsdp.units)
            gathered = comm.stats["ring_all_gather"]["bytes_sent"]
            scattered = comm.stats["ring_reduce_scatter"]["bytes_sent"]
            return psi, dict(tracker.live), shards, gathered, scattered
    for psi, live, shards, gathered, scattered in ThreadWorld(p).run(fn):
        assert shards * p - psi < 3 * p                         # padding: under p per unit
        assert live["params"] <= 4 * shards + 8 * 3               # shards (+ 8-byte placeholders)
        assert live["params"] >= 4 * shards
        assert live["grads"] == 4 * shards
        assert live["optimizer_state"] == 8 * shards
        assert gathered == 2 * (p - 1) * shards * 4              # forward and backward
        assert scattered == (p - 1) * shards * 4                 # 3 (p-1)/p Ψ in all


def test_tied_weights_across_units_are_refused():
    def fn(comm):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        with pytest.raises(ValueError, match="tied weights must live in one unit"):
            FullyShardedDataParallel(model, comm)
    ThreadWorld(2).run(fn)


def test_fsdp_frees_gathered_units_between_forward_and_backward():
    def fn(comm):
        tracker = memory.MemoryTracker()
        with memory.use_tracker(tracker):
            mt.manual_seed(0)
            fsdp = FullyShardedDataParallel(nn.MLP([64, 256, 256, 256, 10]), comm)
            shards = sum(u.flat.shard_size for u in fsdp.units)
            x = np.ones((4, 64), np.float32)
            loss = F.cross_entropy(fsdp(mt.Tensor(x)), np.zeros(4, np.int64))
            after_forward = tracker.live["params"]          # saved weights are references, not copies
            peak_in_forward = tracker.peak_by_category["params"]
            loss.backward()                                  # re-gathers each unit for its backward
            return shards, after_forward, peak_in_forward, comm.stats["ring_all_gather"]["calls"], len(fsdp.units)
    for shards, after_forward, peak, gathers, units in ThreadWorld(2).run(fn):
        assert after_forward <= 4 * shards + 8 * units     # only the shards are alive
        assert peak < 4 * shards * 2 + 4 * 256 * 256        # never the whole model: one unit at a time
        assert gathers == 2 * units                          # once in forward, once in backward


def test_fsdp_with_recomputation_gathers_each_unit_twice_and_frees_it_between():
    """checkpoint_sequential as the model's forward, run through the wrapper (the mlp job's --recompute full):
    each unit gathered once in forward and once more in backward (by its recomputation or by its own backward,
    not also by a prefetch in forward order that a recomputation inside backward does not need), the units
    freed after the forward, and the gradients those of the run without recomputation."""
    from minitrain.parallel import checkpoint_sequential

    def fn(comm):
        mt.set_default_dtype(np.float64)
        out = []
        for recompute in (False, True):
            tracker = memory.MemoryTracker()
            with memory.use_tracker(tracker):
                mt.manual_seed(0)
                model = nn.MLP([64, 96, 80, 72, 10])          # 7 modules: 3 segments, the last not checkpointed
                if recompute:
                    model.forward = lambda x, model=model: checkpoint_sequential(model, None, x)
                fsdp = FullyShardedDataParallel(model, comm)
                shards = sum(u.flat.shard_size for u in fsdp.units)
                x = np.random.default_rng(comm.rank).standard_normal((4, 64))
                comm.stats.reset()
                loss = F.cross_entropy(fsdp(mt.Tensor(x)), np.zeros(4, np.int64))
                after_forward = tracker.live["params"]
                loss.backward()
                grads = [q.grad.copy() for q in fsdp.parameters()]
                out.append((shards, after_forward, comm.stats["ring_all_gather"]["calls"], len(fsdp.units), grads))
        return out
    for (shards, after, gathers, units, grads), (_, after_r, gathers_r, _, grads_r) in ThreadWorld(2).run(fn):
        assert gathers == gathers_r == 2 * units
        assert after <= 8 * shards + 8 * units and after_r <= 8 * shards + 8 * units    # only the shards alive
        assert all(np.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, grads_r))


def test_the_formula_code_reproduces_the_papers_table():
    import runpy
    import pathlib
    from minitrain.parallel.zero_memory import FP32_ADAM, MIXED_PRECISION_ADAM, model_state_bytes
    rows = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "scripts" / "zero_memory_table.py"))["main"]
    import sys
    old, sys.argv = sys.argv, ["zero_memory_table.py"]
    try:
        gb = rows()
    finally:
        sys.argv = old
    assert [round(gb[s], 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    # and the measured fp32-Adam figures above are these formulas with 4 + 4 + 8 bytes
    f = model_state_bytes(1000, 4, 2, **FP32_ADAM)
    assert f == {"params": 4000, "grads": 1000, "optimizer_state": 2000, "total": 7000}
    assert model_state_bytes(1000, 4, 0, **MIXED_PRECISION_ADAM)["total"] == 16000


def test_fsdp_prefetches_the_next_units_all_gather_during_this_units_forward():
    def fn(comm):
        mt.set_default_dtype(np.float64)
        model = nn.MLP([6, 13, 11, 9, 3])
        fsdp = FullyShardedDataParallel(model, comm)
        layers = [u for u in fsdp.units if u.module is not model]
        seen = []
        for i, unit in enumerate(layers[:-1]):
            nxt = layers[i + 1]
            unit.module.register_forward_hook(
                lambda m, a, o, n=nxt: seen.append(n.gathering is not None or n.flat.data is not None))
        F.cross_entropy(fsdp(mt.Tensor(np.ones((4, 6)))), np.zeros(4, np.int64)).backward()
        off = FullyShardedDataParallel(nn.MLP([6, 13, 11, 9, 3]), comm, prefetch=False)
        late = []
        units = [u for u in off.units if u.module is not off.module]
        for i, unit in enumerate(units[:-1]):
            unit.module.register_forward_hook(lambda m, a, o, n=units[i + 1]: late.append(n.flat.data is not None))
        off(mt.Tensor(np.ones((4, 6))))
        return seen, late
    for seen, late in ThreadWorld(2).run(fn):
        assert seen == [True] * 3 and late == [False] * 3


def test_fsdp_eval_under_no_grad_matches_the_model_frees_every_unit_and_keeps_training_exact(float64):
    """PyTorch's inference idiom on FSDP: ``eval()``, a forward under no_grad (no backward follows),
    ``train()``; then ``zero_grad(set_to_none=False)`` keeps zeroed shard gradients, and training
    still equals one process."""
    def fn(comm):
        mt.set_default_dtype(np.float64)
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        fsdp = FullyShardedDataParallel(model, comm)
        reference = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        reference.load_state_dict(fsdp.full_state_dict())
        opt, ref_opt = optim.SGD(fsdp.parameters(), lr=0.1), optim.SGD(reference.parameters(), lr=0.1)
        p, r = comm.size, comm.rank
        for step, (x, y) in enumerate(batches(2, 4 * p)):
            assert fsdp.eval() is fsdp and not model.training
            with mt.no_grad():
                out = fsdp(mt.Tensor(x))
            np.testing.assert_allclose(out.data, reference.eval()(mt.Tensor(x)).data, rtol=1e-12)
            assert all(u.flat.data is None for u in fsdp.units)
            fsdp.train(), reference.train()
            model[1].p = reference[1].p = 0.0                # dropout off: the same numbers on shards
            opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad()
            F.cross_entropy(fsdp(mt.Tensor(x[r::p])), y[r::p]).backward()
            F.cross_entropy(reference(mt.Tensor(x)), y).backward()
            opt.step(), ref_opt.step()
            fsdp.zero_grad(set_to_none=False)
            assert all(q.grad is not None and not q.grad.any() for q in fsdp.parameters())
        full = fsdp.full_state_dict()
        for name, q in reference.named_parameters():
            np.testing.assert_allclose(full[name], q.data, rtol=1e-10, atol=1e-10, err_msg=f"rank {r} {name}")
    ThreadWorld(2).run(fn)


@pytest.mark.parametrize("stage", [1, 2])
def test_model_zero_grad_instead_of_the_optimizers_equals_one_process(stage, float64):
    """PyTorch scripts often call model.zero_grad(): stage 2's shard gradient must not carry the last
    step's into this one, nor stage 1's flat buffer the gradient of a layer this step did not use."""
    def fn(comm):
        mt.set_default_dtype(np.float64)
        mt.manual_seed(comm.rank)
        model = Toy()
        zero = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, comm, stage=stage, bucket_cap_mb=0.001, lr=0.1)
        reference = Toy()
        reference.load_state_dict(model.state_dict())
        ref_opt = optim.SGD([q for q in reference.parameters() if q.requires_grad], lr=0.1)
        p, r = comm.size, comm.rank
        for step, (x, y) in enumerate(batches(3, 4 * p)):
            model.zero_grad()
            reference.zero_grad()
            F.cross_entropy(model(mt.Tensor(x[r::p]), step == 0), y[r::p]).backward()
            F.cross_entropy(reference(mt.Tensor(x), step == 0), y).backward()
            zero.step()
            ref_opt.step()
            assert_same(model, reference, f"rank {r} stage {stage} step {step}")
    ThreadWorld(2).run(fn)


def test_a_unit_mixing_frozen_and_trainable_parameters_is_refused():
    """Its shard is one optimizer parameter, stepped whole: AdamW's weight decay moved the frozen bias."""
    def fn(comm):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        model[2].bias.requires_grad = False
        with pytest.raises(ValueError, match=r"unit 2 mixes frozen parameters \(2.bias\) with trainable ones"):
            FullyShardedDataParallel(model, comm)
        for q in model[2].parameters():               # a whole frozen unit is fine
            q.requires_grad = False
        assert len(FullyShardedDataParallel(model, comm).parameters()) == 1
    ThreadWorld(2).run(fn)

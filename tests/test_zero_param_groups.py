"""ZeRO-1/2 with PyTorch's parameter groups (per-group lr and weight_decay): equal to one process
on the global batch (float64, 1e-10) at p = 3 (groups cut across shards, a rank whose shard misses
a group), with an LR scheduler on top, and a resharding checkpoint that resumes at another p; the
fp32-master optimizer behind ZeRO under float16/bfloat16 takes groups as well."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import checkpoint, nn, optim
from minitrain.backend import bfloat16
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import ZeroRedundancyOptimizer
from test_ddp import Toy, assert_same, batches

GROUP_OPTIONS = [{"weight_decay": 0.1}, {"lr": 0.002, "weight_decay": 0.0}]


def groups(model, trainable_only=False):
    """Weights decay, biases do not, with their own lr (the usual split); frozen ones included
    unless ``trainable_only`` (ZeRO broadcasts them; a single-process optimizer skips them)."""
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad or not trainable_only]
    return [{**GROUP_OPTIONS[0], "params": [q for n, q in named if n.endswith("weight")]},
            {**GROUP_OPTIONS[1], "params": [q for n, q in named if not n.endswith("weight")]}]


def test_a_group_may_hold_one_parameter_not_in_a_list_and_none_may_be_in_two(float64):
    def fn(comm):
        a, b = mt.nn.Parameter(np.ones(3)), mt.nn.Parameter(np.ones(2))
        zero = ZeroRedundancyOptimizer([{"params": a}, {"params": b, "lr": 0.5}], optim.SGD, comm, lr=0.1)
        a.grad, b.grad = np.ones(3), np.ones(2)
        zero.step()
        with pytest.raises(ValueError, match="more than one parameter group"):
            ZeroRedundancyOptimizer([{"params": [a]}, {"params": [a, b]}], optim.SGD, comm, lr=0.1)
        return a.data, b.data
    for a, b in ThreadWorld(2).run(fn):
        np.testing.assert_allclose(a, 0.9)
        np.testing.assert_allclose(b, 0.5)


def toy():
    model = Toy()
    for q in model.sometimes.parameters():           # unused: ZeRO would step it with a zero gradient
        q.requires_grad = False
    return model


def train(model, opt, steps, comm=None, scheduler=None, first=0):
    p, r = (comm.size, comm.rank) if comm is not None else (1, 0)
    for x, y in batches(first + steps, 8 * 6)[first:]:
        opt.zero_grad()
        F.cross_entropy(model(mt.Tensor(x[r::p])), y[r::p]).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def test_zero_param_groups_step_each_group_with_its_options(float64):
    def fn(comm, stage):
        mt.set_default_dtype(np.float64)
        mt.manual_seed(comm.rank)                    # different inits: ZeRO broadcasts rank 0's
        model = toy()
        zero = ZeroRedundancyOptimizer(groups(model), optim.AdamW, comm, stage=stage, bucket_cap_mb=0.0005, lr=0.01)
        reference = toy()
        reference.load_state_dict(model.state_dict())
        ref_opt = optim.AdamW(groups(reference, trainable_only=True), lr=0.01)
        schedulers = [optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (zero, ref_opt)]
        train(model, zero, 3, comm, schedulers[0])
        train(reference, ref_opt, 3, scheduler=schedulers[1])
        assert_same(model, reference, f"rank {comm.rank} stage {stage}")
        return [g["lr"] for g in zero.param_groups], [len(g["params"][0].data) for g in zero.optimizer.param_groups]
    for stage in (1, 2):
        results = ThreadWorld(3).run(fn, stage)
        assert all(lrs == pytest.approx([0.01 / 8, 0.002 / 8]) for lrs, _ in results)
        assert any(0 in sizes for _, sizes in results)          # some rank's shard holds no bias


def test_zero_param_groups_resume_from_a_checkpoint_at_another_world_size(tmp_path, float64):
    def make(comm):
        mt.set_default_dtype(np.float64)
        mt.manual_seed(0)
        model = toy()
        return model, ZeroRedundancyOptimizer(groups(model), optim.AdamW, comm, stage=2, lr=0.01)

    def save(comm):
        model, zero = make(comm)
        train(model, zero, 2, comm)
        checkpoint.save(tmp_path, comm, 2, model, zero)

    def resume(comm):
        model, zero = make(comm)
        checkpoint.load(checkpoint.find_latest(tmp_path), comm, model, zero)
        train(model, zero, 1, comm, first=2)
        return model

    ThreadWorld(2).run(save)
    resumed = ThreadWorld(3).run(resume)
    mt.manual_seed(0)
    reference = toy()
    ref_opt = optim.AdamW(groups(reference, trainable_only=True), lr=0.01)
    train(reference, ref_opt, 3)
    for model in resumed:
        assert_same(model, reference, "resumed at p=3")


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_mixed_precision_optimizer_takes_param_groups(dtype):
    mt.set_default_dtype(np.float32)
    mt.manual_seed(0)
    model = toy().to(dtype)
    opt = optim.MixedPrecisionOptimizer(groups(model, trainable_only=True), optim.SGD, lr=0.5, loss_scale=1.0)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.002]
    before = {n: q.data.astype(np.float32) for n, q in model.named_parameters()}
    for q in model.parameters():
        q.grad = np.ones(q.shape, dtype)
    opt.step()
    for n, q in model.named_parameters():
        if q.requires_grad:
            want = before[n] - (0.5 * (1 + 0.1 * before[n]) if n.endswith("weight") else 0.002)
            np.testing.assert_allclose(q.data.astype(np.float32), want, atol=1e-2, err_msg=n)


def test_add_param_group_is_refused_in_one_line_by_the_optimizers_that_cut_their_state_once():
    """ZeRO's flat buffer and shards, and the mixed-precision masters, are made in the constructor: a group added
    later would be stepped by no one (an AttributeError before), so it is refused naming what to do."""
    from minitrain.comm import ThreadWorld
    from minitrain.optim import MixedPrecisionOptimizer

    def fn(comm):
        zero = ZeroRedundancyOptimizer(nn.Linear(3, 2).parameters(), optim.SGD, comm, lr=0.1)
        with pytest.raises(NotImplementedError, match="ZeroRedundancyOptimizer.add_param_group: .* pass every "
                                                      "parameter group to it"):
            zero.add_param_group({"params": [nn.Parameter(np.zeros(2))]})
        return True
    assert ThreadWorld(2).run(fn) == [True, True]
    mixed = MixedPrecisionOptimizer([nn.Parameter(np.zeros(3, np.float16))], optim.SGD, lr=0.1)
    with pytest.raises(NotImplementedError, match="MixedPrecisionOptimizer.add_param_group"):
        mixed.add_param_group({"params": [nn.Parameter(np.zeros(2))]})

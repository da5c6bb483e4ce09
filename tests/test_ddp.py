"""DDP against single-process training on the global batch (CS336-style): every step, every
parameter, float64 to 1e-10, at p = 1..4, with bucket caps forcing 1, 2 and many buckets,
no_sync accumulation, a frozen parameter, tied weights, unused parameters; bytes per step equal
the ring's formula; overlap shows in the trace."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim, trace
from minitrain.comm import ThreadWorld, chunk_bounds
from minitrain.nn import functional as F
from minitrain.parallel import DistributedDataParallel, check_replicas_equal


class Toy(nn.Module):
    """Tied weights (hidden and hidden_again share one Parameter), a frozen layer, and a layer
    that only some steps use."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.hidden = nn.Linear(8, 8)
        self.hidden_again = nn.Linear(8, 8)
        self.hidden_again.weight = self.hidden.weight          # tied
        self.frozen = nn.Linear(8, 8)
        for p in self.frozen.parameters():
            p.requires_grad = False
        self.out = nn.Linear(8, 3)
        self.sometimes = nn.Linear(8, 3)

    def forward(self, x, use_sometimes=False):
        h = F.relu(self.inp(x))
        h = F.relu(self.hidden(h))
        h = F.relu(self.hidden_again(h))
        h = F.relu(self.frozen(h))
        y = self.out(h)
        return y + self.sometimes(h) if use_sometimes else y


def batches(steps, global_batch, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((global_batch, 6)), rng.integers(0, 3, global_batch)) for _ in range(steps)]


def assert_same(model, reference, where):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, ref[name].data, rtol=1e-10, atol=1e-10, err_msg=f"{where}: {name}")


def run_equivalence(comm, bucket_cap_mb, make_opt, steps=3, accumulate=1, find_unused=False, use_sometimes=()):
    mt.set_default_dtype(np.float64)
    model = Toy()
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused)
    reference = Toy()
    reference.load_state_dict(model.state_dict())        # after the broadcast: rank 0's initial weights
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    p, r = comm.size, comm.rank
    for step, (x, y) in enumerate(batches(steps * accumulate, 4 * p * 2)):
        sometimes = step in use_sometimes
        micro = step % accumulate
        # the single process sees the whole global batch
        if micro == 0:
            ref_opt.zero_grad()
            opt.zero_grad()
        (F.cross_entropy(reference(mt.Tensor(x), sometimes), y) * (1.0 / accumulate)).backward()
        # rank r sees every p-th sample (DistributedSampler's layout)
        loss = F.cross_entropy(ddp(mt.Tensor(x[r::p]), sometimes), y[r::p]) * (1.0 / accumulate)
        if micro < accumulate - 1:
            with ddp.no_sync():
                loss.backward()
            continue
        loss.backward()
        ref_opt.step()
        opt.step()
        assert_same(model, reference, f"rank {r} step {step}")
    check_replicas_equal(model, comm)
    return [len(ddp.buckets), ddp.step_bytes_sent, [b.size for b in ddp.buckets]]


SGD = lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9)   # noqa: E731
ADAM = lambda ps: optim.Adam(ps, lr=0.01)               # noqa: E731


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("cap_mb, expect_buckets", [(25.0, 1), (0.001, 2), (0.0, 9)])
def test_ddp_equals_single_process(p, cap_mb, expect_buckets, float64):
    results = ThreadWorld(p).run(run_equivalence, cap_mb, SGD)
    assert results[0][0] == expect_buckets


@pytest.mark.parametrize("p", [2, 3])
def test_no_sync_accumulation_equals_the_big_batch(p, float64):
    results = ThreadWorld(p).run(run_equivalence, 0.001, ADAM, 2, 3)
    assert results[0][0] == 2


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_gradient_accumulated_under_no_sync_reaches_the_step_when_the_synced_backward_skips_it(find_unused,
                                                                                                  float64):
    """A layer used in a no_sync micro-batch but not in the last (synced) one: its accumulated local
    gradient is what it contributes to the reduction (PyTorch's reducer copies a defined .grad)."""
    ThreadWorld(2).run(run_equivalence, 0.001, SGD, 2, 3, find_unused, (0, 3, 5))


def test_unused_parameters_keep_none_like_one_process(float64):
    # "sometimes" is used in step 1 only: with find_unused_parameters it gets no grad in steps 0 and 2,
    # so Adam leaves it alone exactly as the single process does
    ThreadWorld(3).run(run_equivalence, 0.0, ADAM, 3, 1, True, (1,))


def test_bytes_per_step_equal_the_ring_formula(float64):
    p = 3
    results = ThreadWorld(p).run(run_equivalence, 0.001, SGD)
    for r, (_, sent, sizes) in enumerate(results):
        expected = 0
        for n in sizes:
            b = chunk_bounds(n, p)
            expected += ((n - (b[r + 1] - b[r])) + (n - (b[(r + 1) % p + 1] - b[(r + 1) % p]))) * 8
        assert sent == expected
        psi = sum(sizes)
        assert abs(sent - 2 * (p - 1) / p * psi * 8) <= 2 * len(sizes) * 8    # = 2(p-1)/p·Ψ·b up to rounding


def test_bucket_reduction_overlaps_backward():
    mt.manual_seed(0)
    world = ThreadWorld(2)

    def fn(comm):
        # big enough that backward takes tens of ms (its matmuls release the GIL to the progress thread)
        model = nn.MLP([512, 1024, 1024, 1024, 1024, 10])
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=2)
        x = mt.Tensor(np.random.default_rng(comm.rank).standard_normal((512, 512)).astype(np.float32))
        y = np.zeros(512, np.int64)
        trace.enable(rank=comm.rank)
        with trace.span("backward"):
            F.cross_entropy(ddp(x), y).backward()
        events = trace.events()
        trace.disable()
        return events, len(ddp.buckets)
    for events, n_buckets in world.run(fn):
        assert n_buckets >= 3
        wait_start = min(e["start"] for e in events if e["name"] == "wait for buckets")
        reductions = [e for e in events if e["name"] == "ring_all_reduce"]
        assert len(reductions) == n_buckets
        # the first bucket's all-reduce began while backward was still computing
        assert min(e["start"] for e in reductions) < wait_start


def test_check_replicas_equal_names_the_rank_that_diverged():
    def fn(comm):
        model = nn.Linear(3, 3)
        DistributedDataParallel(model, comm)
        if comm.rank == 2:
            model.weight.data[0, 0] += 1e-3
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\]"):
            check_replicas_equal(model, comm)
    ThreadWorld(3).run(fn)


def test_wrapping_broadcasts_rank0_parameters():
    def fn(comm):
        mt.manual_seed(comm.rank)                 # different initialisations per rank
        model = nn.Linear(4, 4)
        DistributedDataParallel(model, comm)
        return model.weight.data.copy()
    weights = ThreadWorld(3).run(fn)
    assert all(np.array_equal(w, weights[0]) for w in weights)


def test_data_parallel_single_process_equals_one_replica(float64):
    from minitrain.parallel import DataParallel
    model, reference = Toy(), Toy()
    reference.load_state_dict(model.state_dict())
    dp = DataParallel(model, num_replicas=3)
    opt, ref_opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9), optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches(3, 24)):
        for o in (opt, ref_opt):
            o.zero_grad()
        out = dp(mt.Tensor(x))
        np.testing.assert_allclose(out.numpy(), reference(mt.Tensor(x)).numpy(), rtol=1e-12)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(reference(mt.Tensor(x)), y).backward()
        opt.step()
        ref_opt.step()
        assert_same(model, reference, f"DataParallel step {step}")
    # every step: every trainable parameter copied to the 2 other replicas (tied weight once), and
    # gradients sent back for the ones this forward used ("sometimes" was not)
    psi = sum(p.size for p in model.parameters() if p.requires_grad)
    used = psi - model.sometimes.weight.size - model.sometimes.bias.size
    assert dp.stats["replicate_bytes"] == 3 * 2 * psi * 8
    assert dp.stats["reduce_bytes"] == 3 * 2 * used * 8
    assert dp.stats["scatter_bytes"] == 3 * 16 * 6 * 8 and dp.stats["gather_bytes"] == 3 * 16 * 3 * 8


def test_ddp_has_the_module_methods_a_training_loop_calls(float64):
    """ddp.zero_grad(set_to_none=False) (kept zeroed buffers the reduction writes into),
    ddp.load_state_dict, ddp.eval(): still one process on the global batch."""
    def fn(comm):
        mt.set_default_dtype(np.float64)
        model, reference = Toy(), Toy()
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.0005)
        ddp.load_state_dict(reference.state_dict())
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        p, r = comm.size, comm.rank
        for step, (x, y) in enumerate(batches(3, 4 * p)):
            assert ddp.eval() is ddp and not model.training
            ddp.train()
            ddp.zero_grad(set_to_none=False)
            if step:                                     # the previous step's buffers, zeroed
                assert all(q.grad is not None and not q.grad.any() for q in model.parameters() if q.requires_grad)
            reference.zero_grad()
            F.cross_entropy(ddp(mt.Tensor(x[r::p])), y[r::p]).backward()
            F.cross_entropy(reference(mt.Tensor(x)), y).backward()
            opt.step(), ref_opt.step()
            assert_same(model, reference, f"rank {r} step {step}")
    ThreadWorld(2).run(fn)


@pytest.mark.parametrize("cap", [-1.0, float("nan"), float("inf"), True])
def test_a_bucket_cap_that_is_not_a_finite_size_is_refused_by_ddp_and_zero(cap):
    """NaN ended in int()'s 'cannot convert float NaN to integer', and a negative cap was taken; 0 is PyTorch's
    'a bucket per parameter' and stays."""
    from minitrain.parallel import ZeroRedundancyOptimizer

    def fn(comm):
        model = nn.MLP([3, 4, 2])
        for make, who in ((lambda: DistributedDataParallel(model, comm, bucket_cap_mb=cap), "DistributedDataParallel"),
                          (lambda: ZeroRedundancyOptimizer(model.parameters(), optim.SGD, comm, bucket_cap_mb=cap, lr=0.1),
                           "ZeroRedundancyOptimizer")):
            with pytest.raises(ValueError, match=f"{who}: bucket_cap_mb must be a finite number of MiB, 0 or more"):
                make()
        return len(DistributedDataParallel(model, comm, bucket_cap_mb=0).buckets)
    assert ThreadWorld(2).run(fn) == [len(list(nn.MLP([3, 4, 2]).parameters()))] * 2


def test_a_sampler_of_a_negative_number_of_samples_is_refused():
    from minitrain.data.sampler import DistributedSampler
    with pytest.raises(ValueError, match="DistributedSampler: the number of samples must be >= 0, got -3"):
        DistributedSampler(-3, num_replicas=1, rank=0)

"""A parameter that some ranks use in a step and others do not (a branch taken by the data, as
PyTorch's find_unused_parameters is for): DDP and ZeRO-2 still issue their bucket collectives in
the same order on every rank (complete buckets launch in bucket order, the rest at the end of
backward), and the step equals one process summing the ranks' losses (float64, 1e-10)."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import optim
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from test_ddp import Toy, assert_same, batches

CAP_MB = 0.0005                 # many buckets: the unused layer's bucket is the first to reduce


def train_where_only_rank_0_uses_a_layer(comm, wrap):
    mt.set_default_dtype(np.float64)
    model = Toy()
    forward, opt = wrap(model, comm)
    reference = Toy()
    reference.load_state_dict(model.state_dict())
    ref_opt = optim.SGD([q for q in reference.parameters() if q.requires_grad], lr=0.1, momentum=0.9)
    p, r = comm.size, comm.rank
    for step, (x, y) in enumerate(batches(3, 4 * p)):
        opt.zero_grad()
        F.cross_entropy(forward(mt.Tensor(x[r::p]), r == 0), y[r::p]).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(F.cross_entropy(reference(mt.Tensor(x[k::p]), k == 0), y[k::p]) * (1.0 / p) for k in range(p)).backward()
        ref_opt.step()
        assert_same(model, reference, f"rank {r} step {step}")


def ddp(find_unused):
    def wrap(model, comm):
        return (DistributedDataParallel(model, comm, bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused),
                optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.1, momentum=0.9))
    return wrap


def zero(stage):
    def wrap(model, comm):
        return model, ZeroRedundancyOptimizer(model.parameters(), optim.SGD, comm, stage=stage, bucket_cap_mb=CAP_MB,
                                              lr=0.1, momentum=0.9)
    return wrap


@pytest.mark.parametrize("wrap", [ddp(False), ddp(True), zero(2)], ids=["ddp", "ddp-find-unused", "zero2"])
def test_a_layer_only_one_rank_uses_is_reduced_in_the_same_bucket_order_on_every_rank(wrap, float64):
    ThreadWorld(3, comm_timeout=5.0).run(train_where_only_rank_0_uses_a_layer, wrap)

"""ZeRO-Offload: optimizer state and master weights on the host (stages 1-3), parameters too under
FSDP; the same parameters as one process (float64, 1e-10), and device/host bytes as the formulas."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import memory, nn, optim
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel import (CPUOffloadOptimizer, DistributedDataParallel, FullyShardedDataParallel,
                                ZeroRedundancyOptimizer)
from test_ddp import batches

SIZES = [6, 13, 11, 3]          # 279 parameters: not divisible by 2, 3 or 4


def _init():
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    return nn.MLP(SIZES).state_dict()


def _train(comm, stage, init, offload, steps=3):
    mt.set_default_dtype(np.float64)
    model = nn.MLP(SIZES)
    model.load_state_dict(init)
    p, r = comm.size, comm.rank
    if stage in (1, 2):
        opt, forward = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, comm, stage=stage,
                                               bucket_cap_mb=0.001, offload=offload, lr=1e-2), model
    elif stage == 3:
        forward = FullyShardedDataParallel(model, comm, offload_params=offload)
        opt = (CPUOffloadOptimizer(forward.parameters(), optim.Adam, lr=1e-2) if offload
               else optim.Adam(forward.parameters(), lr=1e-2))
    else:
        forward = model if p == 1 else DistributedDataParallel(model, comm)
        opt = optim.Adam(model.parameters(), lr=1e-2)
    device = host = None
    for x, y in batches(steps, 24):            # the same global batch at every p
        opt.zero_grad()
        F.cross_entropy(forward(mt.Tensor(x[r::p])), y[r::p]).backward()
        opt.step()
        if device is None:
            device, host = memory.snapshot(), memory.host_snapshot()
    state = forward.full_state_dict() if stage == 3 else {n: q.data.copy() for n, q in model.named_parameters()}
    return state, device, host


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_equals_one_process_and_moves_the_optimizer_to_the_host(stage, p):
    init = _init()
    reference = ThreadWorld(1).run(_train, 0, init, False)[0][0]
    psi = sum(v.size for v in init.values())
    shard = -(-psi // p) * 8                       # one rank's padded shard, float64
    for state, device, host in ThreadWorld(p).run(_train, stage, init, True):
        for name, value in reference.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-10, err_msg=name)
        assert device["optimizer_state"] == 0
        if stage < 3:
            # host: the shard's master copy + Adam's two moments; device: parameters + gradients
            assert host["optimizer_state"] == 3 * shard
            assert device["params"] == shard * p        # the whole flat (padded) buffer
            assert device["grads"] == (shard * p if stage == 1 else shard)
        else:
            # FSDP + offload: nothing of the model's state stays on the device between steps
            assert device["params"] < 64 and device["grads"] == 0
            assert host["params"] >= psi * 8 / p and host["optimizer_state"] >= 3 * psi * 8 / p


def test_a_model_that_does_not_fit_under_ddp_fits_with_zero3_offload():
    init = _init()

    def run(comm, strategy):
        memory.tracker().capacity = None
        mt.set_default_dtype(np.float64)
        model = nn.MLP(SIZES)
        model.load_state_dict(init)
        capacity = 279 * 8 * 3          # less than DDP's params + grads + 2 Adam moments (4 x 2,232)
        try:
            if strategy == "ddp":
                memory.set_device_capacity(capacity)
                _train_steps(comm, DistributedDataParallel(model, comm), optim.Adam(model.parameters(), lr=1e-2))
            else:
                fsdp = FullyShardedDataParallel(model, comm, offload_params=True)
                memory.set_device_capacity(capacity)
                _train_steps(comm, fsdp, CPUOffloadOptimizer(fsdp.parameters(), optim.Adam, lr=1e-2))
            return "fits"
        except memory.DeviceOutOfMemory as e:
            return str(e)
        finally:
            memory.set_device_capacity(None)

    ddp = ThreadWorld(2).run(run, "ddp")
    assert all("exceed the device capacity" in r for r in ddp), ddp
    assert ThreadWorld(2).run(run, "zero3_offload") == ["fits", "fits"]


def _train_steps(comm, forward, opt):
    p, r = comm.size, comm.rank
    for x, y in batches(2, 8 * p):
        opt.zero_grad()
        F.cross_entropy(forward(mt.Tensor(x[r::p])), y[r::p]).backward()
        opt.step()

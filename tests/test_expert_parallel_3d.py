"""Expert parallelism inside GPT3D (--ep with dp x pp x tp; parallel/expert_parallel_3d.py) trains as one
process does: float64, losses, the step's MoE figures and the parameters within 1e-10 relative over 10
steps, one process given the run's moe_groups. In-process (ThreadWorld): dp x tp, dp x pp (1F1B, the
zero-bubble schedules), ep = dp and ep < dp (an expert data-parallel group of 2), top-1 with a capacity
factor, full recomputation; under mpiexec the job's --json at 4 ranks against one process's job, its
all-to-all bytes measured equal to the formula from the split sizes."""
import dataclasses

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.comm import ThreadWorld
from minitrain.parallel.expert_parallel_3d import ExpertParallelReplicatedMoE
from minitrain.parallel.gpt_3d import GPT3D

from test_moe_3d import CONFIG, reference_run, run_3d

CASES = {   # mesh, GPT3D's options, the config's moe fields (groups: a multiple of dp x micro-batches)
    "dp2 tp2 ep2": (dict(dp=2, tp=2), dict(ep=2), dict(moe_groups=2)),
    "dp2 pp2 ep2 1f1b m2": (dict(dp=2, pp=2), dict(ep=2, schedule="1f1b", num_microbatches=2), dict(moe_groups=4)),
    "dp4 ep2 capacity top-1": (dict(dp=4), dict(ep=2), dict(moe_groups=4, moe_top_k=1, moe_capacity_factor=1.0)),
    "dp4 ep4 every 2": (dict(dp=4), dict(ep=4), dict(moe_groups=4, moe_every=2)),
    "dp2 pp2 ep2 zb_h1 m2": (dict(dp=2, pp=2), dict(ep=2, schedule="zb_h1", num_microbatches=2), dict(moe_groups=4)),
    "dp2 pp2 ep2 zbv m2": (dict(dp=2, pp=2), dict(ep=2, schedule="zbv", num_microbatches=2, chunks=2),
                           dict(n_layer=4, moe_groups=4)),
    "dp2 tp2 ep2 capacity recompute full": (dict(dp=2, tp=2), dict(ep=2),
                                            dict(moe_groups=2, moe_capacity_factor=1.0, recompute="full")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_gpt3d_trains_as_one_process(case):
    mesh, kwargs, moe = CASES[case]
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, **moe})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses, expected_stats = reference_run(dataclasses.replace(config, recompute=None), init)
    if moe.get("moe_capacity_factor"):
        assert sum(s[1] for s in expected_stats) > 0          # tokens were dropped: the groups matter
    size = mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1)
    for state, losses, stats in ThreadWorld(size).run(run_3d, config, init, mesh, **kwargs):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10, atol=0)
        assert [s[1] for s in stats] == [s[1] for s in expected_stats]
        np.testing.assert_allclose([s[0] for s in stats], [s[0] for s in expected_stats], rtol=1e-12, atol=0)
        np.testing.assert_allclose([s[2] for s in stats], [s[2] for s in expected_stats], rtol=1e-10, atol=0)
        assert set(state) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)

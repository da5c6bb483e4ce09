"""3D parallelism (dp x pp x tp) on the GPT equals the single-process GPT on the global batch
(float64, 1e-10, 3 steps of SGD with momentum and clipping by the global norm: SGD, unlike Adam,
would show a gradient off by any factor), for pipeline schedules GPipe / 1F1B / interleaved, with
and without sequence parallelism, with dropout (one process's masks); and the shapes that cannot work are clear
errors."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.comm import MeshError, ThreadWorld
from minitrain.parallel.gpt_3d import GPT3D

CONFIG = dict(vocab_size=23, block_size=16, n_layer=2, n_head=4, n_embd=16)


def data(steps=3, B=8, T=8):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 23, (B, T)), rng.integers(0, 23, (B, T))) for _ in range(steps)]


def reference_run(config, init, B=8, steps=3):
    model = nn.GPT(config)
    model.load_state_dict(init)
    opt = optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x, y in data(steps, B=B):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def run_3d(comm, config, init, mesh, B=8, steps=3, **kwargs):
    mt.set_default_dtype(np.float64)
    gpt = nn.GPT(config)
    gpt.load_state_dict(init)
    model = GPT3D(gpt, comm, **mesh, **kwargs)
    opt = optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x, y in data(steps, B=B):
        model.zero_grad()
        losses.append(model.train_step(x, y))
        model.clip_grad_norm_(0.5)
        opt.step()
    return model.full_state_dict(), losses


def dropout_run(mesh, kwargs, dropout=0.2):
    """GPT3D on ``mesh`` with dropout (``kwargs``' recompute: the config's) == one process's run, masks and all."""
    kwargs = dict(kwargs)
    B = kwargs.pop("B", 8)
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**CONFIG, dropout=dropout, recompute=kwargs.pop("recompute", None))
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    mt.manual_seed(1)                                   # the masks' stream, the same on every rank
    expected, expected_losses = reference_run(config, init, B)

    def run(comm):
        mt.manual_seed(1)
        return run_3d(comm, config, init, mesh, B, **kwargs)
    for state, losses in ThreadWorld(int(np.prod(list(mesh.values())))).run(run):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


CASES = {   # mesh, pipeline schedule
    "pp2": (dict(pp=2), dict(schedule="1f1b", num_microbatches=2)),
    "tp2": (dict(tp=2), dict()),
    "pp2xtp2": (dict(pp=2, tp=2), dict(schedule="1f1b", num_microbatches=2)),
    "dp2xpp2xtp2": (dict(dp=2, pp=2, tp=2), dict(schedule="1f1b", num_microbatches=2)),
    "dp2xpp2xtp2+sp gpipe": (dict(dp=2, pp=2, tp=2), dict(schedule="gpipe", num_microbatches=4,
                                                            sequence_parallel=True)),
    "pp2xtp2+sp interleaved": (dict(pp=2, tp=2), dict(schedule="interleaved_1f1b", num_microbatches=2, chunks=2,
                                                      sequence_parallel=True)),
    "dp2xtp2+sp": (dict(dp=2, tp=2), dict(num_microbatches=2, sequence_parallel=True)),
    "pp4xtp2+sp": (dict(pp=4, tp=2), dict(num_microbatches=4, sequence_parallel=True)),
}


# batches that the replicas or the micro-batches do not divide: 3 rows on dp 2 (2 + 1, then m = 2: an
# empty micro-batch), on dp 4 (a replica without rows), 5 rows into m = 3 (2 + 2 + 1)
UNEVEN = {
    "dp2xtp2 3 rows": (dict(dp=2, tp=2), dict(num_microbatches=2, B=3)),
    "dp4 3 rows": (dict(dp=4), dict(B=3)),
    "pp2xtp2 5 rows": (dict(pp=2, tp=2), dict(schedule="1f1b", num_microbatches=3, B=5)),
}


@pytest.mark.parametrize("case", list(CASES) + list(UNEVEN))
def test_3d_gpt_equals_the_gpt_on_the_global_batch(case):
    mesh, kwargs = {**CASES, **UNEVEN}[case]
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**CONFIG)
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses = reference_run(config, init, kwargs.get("B", 8))
    size = mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1)
    for state, losses in ThreadWorld(size).run(run_3d, config, init, mesh, **kwargs):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10)
        assert set(state) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


DROPOUT = {   # mesh, GPT3D's other arguments (recompute: the config's)
    "dp4 3 rows": (dict(dp=4), dict(B=3)),                  # a replica without rows
    "dp2 3 rows m2 recompute selective": (dict(dp=2), dict(num_microbatches=2, B=3, recompute="selective")),
    "pp2 zb_h1 m4 recompute full": (dict(pp=2), dict(schedule="zb_h1", num_microbatches=4, recompute="full")),
    "dp2xpp2xtp2+sp interleaved": (dict(dp=2, pp=2, tp=2), dict(schedule="interleaved_1f1b", num_microbatches=2,
                                                              chunks=2, sequence_parallel=True)),
}


@pytest.mark.parametrize("case", list(DROPOUT))
def test_3d_gpt_draws_one_process_s_dropout_masks(case):
    """Each dropout site's mask is one process's at the rows, positions and heads a rank computes, whatever
    replica, micro-batch or pipeline order computes them, and recomputed forwards draw them again."""
    dropout_run(*DROPOUT[case])


def test_shapes_that_cannot_work_are_clear_errors():
    mt.set_default_dtype(np.float64)
    config = nn.GPTConfig(**CONFIG)
    with pytest.raises(MeshError, match=r"dp=2 x pp=2 x tp=2 = 8 ranks does not fit a world of 6"):
        ThreadWorld(6).run(lambda comm: GPT3D(nn.GPT(config), comm, dp=2, pp=2, tp=2))
    tied = nn.GPTConfig(**CONFIG, tie_weights=True)
    with pytest.raises(ValueError, match=r"\[rank \d\] tied embeddings with pp = 2"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(tied), comm, pp=2))
    with pytest.raises(ValueError, match="4 layers cannot fill pp x chunks = 6"):
        ThreadWorld(3).run(lambda comm: GPT3D(nn.GPT(config), comm, pp=3, chunks=2, num_microbatches=3,
                                              schedule="interleaved_1f1b"))

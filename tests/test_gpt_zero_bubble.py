"""Zero-bubble schedules on the GPT (Qi et al. 2024: ZB-H1, ZB-V) through GPT3D and the GPT job: in
float64 every layout trains with one process's losses (within 1e-10 relative, 10 steps of SGD with
momentum and clipping by the global norm) at 2 and 4 ranks, with tp (and sequence parallelism), dp,
recompute and uneven micro-batches; zbv's V puts the embedding and the head on rank 0; the split backward sends on
the tensor-parallel communicator what the whole one sends; the --chunks rules and the layers that cannot
fill the V are one clear error; the job's bubble says which costs it simulates."""
import functools
import json
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.comm import ThreadWorld
from minitrain.examples import gpt
from minitrain.parallel.gpt_3d import GPT3D
from minitrain.parallel.pipeline import formula_bubble_fraction
from minitrain.testing import run_mpi
import test_gpt_3d
from test_gpt_3d import data

CONFIG = dict(vocab_size=23, block_size=16, n_layer=2, n_head=4, n_embd=16)
STEPS = 10


reference_run = functools.partial(test_gpt_3d.reference_run, steps=STEPS)
run_3d = functools.partial(test_gpt_3d.run_3d, steps=STEPS)


def initial(**config):
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, **config})
    return config, {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}


def ranks(mesh):
    return mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1)


CASES = {   # mesh, GPT3D's pipeline options (and B: the global batch's rows), GPTConfig changes
    "pp2 zb_h1 m2": (dict(pp=2), dict(schedule="zb_h1", num_microbatches=2), {}),
    "pp2 zb_h1 m4": (dict(pp=2), dict(schedule="zb_h1", num_microbatches=4), {}),
    "pp2 zbv m2": (dict(pp=2), dict(schedule="zbv", num_microbatches=2), {}),
    "pp2 zbv m4": (dict(pp=2), dict(schedule="zbv", num_microbatches=4), {}),
    "pp2 zbv m4, 6 layers in the V": (dict(pp=2), dict(schedule="zbv", num_microbatches=4), dict(n_layer=4)),
    "pp2xtp2 zb_h1 m4": (dict(pp=2, tp=2), dict(schedule="zb_h1", num_microbatches=4), {}),
    "pp2xtp2 zbv m2": (dict(pp=2, tp=2), dict(schedule="zbv", num_microbatches=2), {}),
    "pp2xtp2+sp zb_h1 m2": (dict(pp=2, tp=2), dict(schedule="zb_h1", num_microbatches=2, sequence_parallel=True), {}),
    "pp2xtp2+sp zbv m4": (dict(pp=2, tp=2), dict(schedule="zbv", num_microbatches=4, sequence_parallel=True), {}),
    "dp2xpp2 zb_h1 m4": (dict(dp=2, pp=2), dict(schedule="zb_h1", num_microbatches=4), {}),
    "dp2xpp2 zbv m2": (dict(dp=2, pp=2), dict(schedule="zbv", num_microbatches=2), {}),
    "pp2xtp2+sp zbv recompute full": (dict(pp=2, tp=2), dict(schedule="zbv", num_microbatches=2,
                                                             sequence_parallel=True), dict(recompute="full")),
    "pp2xtp2 zb_h1 recompute selective": (dict(pp=2, tp=2), dict(schedule="zb_h1", num_microbatches=2),
                                          dict(recompute="selective")),
    "pp2 zbv 5 rows into m3": (dict(pp=2), dict(schedule="zbv", num_microbatches=3, B=5), {}),
    "pp2 zbv m1": (dict(pp=2), dict(schedule="zbv", num_microbatches=1), {}),
    "pp4 zb_h1 m8": (dict(pp=4), dict(schedule="zb_h1", num_microbatches=8), {}),
    "pp4 zbv m4, 8 layers in the V": (dict(pp=4), dict(schedule="zbv", num_microbatches=4), dict(n_layer=6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_bubble_gpt_equals_one_process(case):
    mesh, kwargs, changes = CASES[case]
    config, init = initial(**changes)
    expected, expected_losses = reference_run(config, init, kwargs.get("B", 8))
    for state, losses in ThreadWorld(ranks(mesh)).run(run_3d, config, init, mesh, **kwargs):
        assert len(losses) == STEPS
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10)
        assert set(state) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_dropout_draws_1f1bs_masks_under_zb_h1():
    """ZB-H1 runs each stage's forwards in 1F1B's order, so with dropout (masks drawn per micro-batch, in
    forward order) it trains as 1F1B does: the deferred weight gradients see the same dropped units."""
    config, init = initial(dropout=0.2)
    mesh = dict(pp=2, tp=2)
    runs = {schedule: ThreadWorld(4).run(run_3d, config, init, mesh, schedule=schedule, num_microbatches=4,
                                         sequence_parallel=True)
            for schedule in ("1f1b", "zb_h1")}
    _, plain = reference_run(nn.GPTConfig(**CONFIG), init)
    for (_, one), (_, zb) in zip(runs["1f1b"], runs["zb_h1"]):
        np.testing.assert_allclose(zb, one, rtol=1e-10)
        assert abs(zb[0] - plain[0]) > 1e-6                    # the dropout did drop something


def _describe(comm, config, init, schedule):
    mt.set_default_dtype(np.float64)
    gpt_model = nn.GPT(config)
    gpt_model.load_state_dict(init)
    model = GPT3D(gpt_model, comm, pp=2, schedule=schedule, num_microbatches=4)
    return model.pipe.stage_rows, model.pipe.loss_rank


def test_zbv_puts_the_embedding_and_the_head_on_rank_0():
    config, init = initial(n_layer=4)
    rows, loss_rank = ThreadWorld(2).run(_describe, config, init, "zbv")[0]
    where = [(r["rank"], r["chunk"]) for r in rows]
    assert where == [(0, 0), (1, 0), (1, 1), (0, 1)]           # down the ranks, back up: a V
    assert rows[0]["layers"][0] == "0:EmbeddingStage" and rows[-1]["layers"][-1] == "5:HeadStage"
    assert sum(len(r["layers"]) for r in rows) == 6 and loss_rank == 0


def _tp_bytes(comm, config, init, schedule, sequence_parallel):
    mt.set_default_dtype(np.float64)
    gpt_model = nn.GPT(config)
    gpt_model.load_state_dict(init)
    model = GPT3D(gpt_model, comm, pp=2, tp=2, schedule=schedule, num_microbatches=2,
                  sequence_parallel=sequence_parallel)
    tp = model.mesh.comm("tp")
    before = tp.stats.bytes_sent
    for x, y in data(steps=2):
        model.zero_grad()
        model.train_step(x, y)
    return tp.stats.bytes_sent - before


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_the_split_backward_sends_what_the_whole_one_sends(sequence_parallel):
    """B takes the input gradient's collectives (f's all-reduce, the reduce-scatter), W the weights' (the
    sequence-parallel re-gather): nothing is sent twice. ZB-H1 places the layers as 1F1B does, rank by
    rank; zbv's V places them otherwise, so the same bytes in total."""
    config, init = initial()
    sent = {s: ThreadWorld(4).run(_tp_bytes, config, init, s, sequence_parallel) for s in ("1f1b", "zb_h1", "zbv")}
    assert sent["zb_h1"] == sent["1f1b"]
    assert sum(sent["zbv"]) == sum(sent["1f1b"])


def test_what_cannot_work_is_one_clear_error():
    config, _ = initial()
    with pytest.raises(ValueError, match=r"4 layers cannot fill pp x chunks = 6 pipeline stages \(zbv's V: 2 chunks"):
        ThreadWorld(3).run(lambda comm: GPT3D(nn.GPT(config), comm, pp=3, schedule="zbv", num_microbatches=3))
    with pytest.raises(ValueError, match=r"zbv is a V of exactly 2 chunks per stage, got chunks=3"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, pp=2, schedule="zbv", chunks=3))
    with pytest.raises(ValueError, match=r"chunks=2 needs the interleaved_1f1b schedule, not 'zb_h1'"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, pp=2, schedule="zb_h1", chunks=2))
    tied = nn.GPTConfig(**CONFIG, tie_weights=True)
    for schedule in ("zb_h1", "zbv"):
        with pytest.raises(ValueError, match=r"\[rank \d\] tied embeddings with pp = 2"):
            ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(tied), comm, pp=2, schedule=schedule, num_microbatches=2))


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--schedule", "zb_h1", "--chunks", "1"],
     "error: --chunks is not supported with --schedule zb_h1 (ZB-H1 runs one chunk per rank"),
    (["--pp", "2", "--schedule", "zbv", "--chunks", "3"],
     "error: --chunks 3 is not supported with --schedule zbv (its V is exactly 2 chunks per rank"),
    (["--schedule", "zbv"], "error: --schedule is not supported with --pp 1"),
])
def test_the_job_refuses_chunks_a_zero_bubble_schedule_cannot_take(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpt.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len([x for x in err.splitlines() if "error:" in x]) == 1


def test_zbv_takes_its_two_chunks_given_or_not():
    for argv in (["--pp", "2", "--schedule", "zbv"], ["--pp", "2", "--schedule", "zbv", "--chunks", "2"]):
        assert gpt.parse_args(argv).chunks == 2
    assert gpt.parse_args(["--pp", "2", "--schedule", "zb_h1"]).chunks == 1


@pytest.mark.parametrize("n, flags", [(2, ["--pp", "2", "--schedule", "zbv", "--microbatches", "4"]),
                                      (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb_h1",
                                           "--microbatches", "2"])], ids=["pp2 zbv", "pp2xtp2+sp zb_h1"])
def test_the_job_trains_as_one_process_and_says_which_bubble(tmp_path, n, flags):
    common = ["--steps", "10", "--precision", "fp64", "--no-progress", "--sample-chars", "5", "--batch-size", "8"]
    one = tmp_path / "one.json"
    assert gpt.main([*common, "--json", str(one)]) == 0
    out = tmp_path / "zb.json"
    result = run_mpi([sys.executable, "-m", "minitrain.examples.gpt", *common, *flags, "--json", out], n=n, timeout=180)
    expected, report = json.loads(one.read_text())["losses"], json.loads(out.read_text())
    assert len(report["losses"]) == 10
    np.testing.assert_allclose(report["losses"], expected, rtol=1e-10)
    schedule, m = flags[flags.index("--schedule") + 1], int(flags[flags.index("--microbatches") + 1])
    assert report["schedule"] == schedule and report["chunks"] == (2 if schedule == "zbv" else 1)
    assert report["bubble_formula"] == pytest.approx(formula_bubble_fraction(schedule, 2, m, 1, 1.0, 1.0, 1.0))
    assert report["bubble_formula_costs"] == {"F": 1.0, "B": 1.0, "W": 1.0}
    assert "simulated (no closed form) with equal stages and F = B = W per chunk" in result.stdout
    heaviest = max(r["memory"]["peak"]["total"] for r in report["ranks"])
    assert report["planner"]["predicted"]["memory_bytes"] == heaviest   # B frees what W does not need: to the byte


def test_the_job_refuses_layers_that_cannot_fill_the_v_in_one_line():
    result = run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--pp", "2", "--schedule", "zbv", "--n-layer", "1",
                      "--steps", "2", "--no-progress"], n=2, timeout=60, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and "3 layers cannot fill pp x chunks = 4 pipeline stages (zbv's V: 2 chunks" in errors[0]

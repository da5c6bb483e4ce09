"""ZeRO on GPT3D's data-parallel axis (parallel/zero_3d.py): --zero 1, 2, 3 at dp 2, dp 2 x tp 2 and
dp 2 x pp 2 train as one process does (float64, AdamW with weight decay, clipping by the global norm:
losses and norms within 1e-10 relative over 10 steps; the norm would show a gradient off by any factor,
which Adam's update hides); the ledger's model states per rank shrink as the stages say; checkpoints
resume across stages and layouts; the job's JSON reports the stage and its memory."""
import json
import math
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import checkpoint, memory, nn, optim
from minitrain.comm import ThreadWorld
from minitrain.examples import gpt
from minitrain.parallel.gpt_3d import GPT3D
from minitrain.testing import run_mpi

CONFIG = dict(vocab_size=23, block_size=16, n_layer=2, n_head=4, n_embd=16)
STEPS, MAX_NORM = 10, 0.5


def data(B=8, T=8):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 23, (B, T)), rng.integers(0, 23, (B, T))) for _ in range(STEPS)]


def make_opt(params):
    return optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference_run(config, init, B=8):
    model = nn.GPT(config)
    model.load_state_dict(init)
    opt = make_opt(model.parameters())
    losses, norms = [], []
    for x, y in data(B):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        norms.append(float(optim.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def run_zero(comm, config, init, mesh, zero, B=8, **kwargs):
    mt.set_default_dtype(np.float64)
    gpt_model = nn.GPT(config)
    gpt_model.load_state_dict(init)
    model = GPT3D(gpt_model, comm, **mesh, **kwargs, zero=zero)
    del gpt_model
    opt = model.optimizer(make_opt)
    losses, norms = [], []
    for x, y in data(B):
        model.zero_grad()
        losses.append(model.train_step(x, y))
        norms.append(float(model.clip_grad_norm_(MAX_NORM)))
        opt.step()
    return losses, norms, memory.snapshot(), model.full_state_dict()


@pytest.fixture(scope="module")
def reference():
    old = mt.get_default_dtype()                # a module fixture: conftest's per-test restore does not cover it
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**CONFIG)
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    yield config, init, reference_run(config, init)
    mt.set_default_dtype(old)


LAYOUTS = {"dp2": (dict(dp=2), {}),
           "dp2xtp2": (dict(dp=2, tp=2), dict(num_microbatches=2)),
           "dp2xpp2": (dict(dp=2, pp=2), dict(schedule="1f1b", num_microbatches=2))}


def size(mesh):
    return math.prod(mesh.values())


def assert_close(results, expected):
    losses, norms, state = expected
    for got_losses, got_norms, _, got_state in results:
        np.testing.assert_allclose(got_losses, losses, rtol=1e-10)
        np.testing.assert_allclose(got_norms, norms, rtol=1e-10)
        for name, value in state.items():
            np.testing.assert_allclose(got_state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_on_dp_equals_one_process(reference, layout, zero):
    config, init, expected = reference
    mesh, kwargs = LAYOUTS[layout]
    assert_close(ThreadWorld(size(mesh)).run(run_zero, config, init, mesh, zero, **kwargs), expected)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_with_sequence_parallelism_and_an_uneven_batch(zero):
    """SP's replicated partial sums over tp, then the reduce-scatter over dp; 3 rows on dp 2 (2 + 1)."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(1)
    config = nn.GPTConfig(**CONFIG)
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    mesh = dict(dp=2, tp=2)
    results = ThreadWorld(4).run(run_zero, config, init, mesh, zero, B=3, num_microbatches=2, sequence_parallel=True)
    assert_close(results, reference_run(config, init, B=3))


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_on_dp2_x_pp2_x_tp2_interleaved_with_sequence_parallelism(reference, zero):
    """8 ranks (threads): two chunks per pipeline rank, each rank's shard cut across both."""
    config, init, expected = reference
    mesh = dict(dp=2, pp=2, tp=2)
    assert_close(ThreadWorld(8).run(run_zero, config, init, mesh, zero, schedule="interleaved_1f1b", chunks=2,
                                    num_microbatches=2, sequence_parallel=True), expected)


def test_zero_with_tied_embeddings():
    """wte and lm_head are one parameter: one place in the flat buffer."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(2)
    config = nn.GPTConfig(**CONFIG, tie_weights=True)
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    assert_close(ThreadWorld(4).run(run_zero, config, init, dict(dp=2, tp=2), 3), reference_run(config, init))


def test_model_states_per_rank_shrink_by_stage(reference):
    """Between steps, per rank (float64, S = ceil(Ψ_stage / dp)): AdamW's two moments 2·Ψ·8 bytes at
    ZeRO-0 become 2·S·8 at 1 to 3, the gradients S·8 at 2 and 3, the parameters S·8 at 3 (and a few
    bytes of the placeholders that keep the freed parameters' shapes)."""
    config, init, _ = reference
    for layout in ("dp2", "dp2xpp2"):
        mesh, kwargs = LAYOUTS[layout]
        ledgers = {zero: [r[2] for r in ThreadWorld(size(mesh)).run(run_zero, config, init, mesh, zero, **kwargs)]
                   for zero in (0, 1, 2, 3)}
        for rank, plain in enumerate(ledgers[0]):
            psi = plain["optimizer_state"] // 16                 # this rank's stage's parameters
            shard = math.ceil(psi / 2) * 8
            assert plain["grads"] == psi * 8
            for zero in (1, 2, 3):
                assert ledgers[zero][rank]["optimizer_state"] == 2 * shard, (layout, zero, rank)
            assert ledgers[1][rank]["grads"] == 2 * shard         # the padded flat buffer, whole
            assert ledgers[2][rank]["grads"] == ledgers[3][rank]["grads"] == shard
            assert ledgers[2][rank]["params"] == plain["params"] + 2 * shard - psi * 8    # padded
            assert shard <= ledgers[3][rank]["params"] <= shard + 256


def bytes_on_dp_per_step(comm, config, init, zero):
    mt.set_default_dtype(np.float64)
    gpt_model = nn.GPT(config)
    gpt_model.load_state_dict(init)
    model = GPT3D(gpt_model, comm, dp=2, zero=zero)
    opt = model.optimizer(make_opt)
    (x, y), dp = data()[0], model.mesh.comm("dp")
    before = dp.stats.bytes_sent
    model.zero_grad()
    model.train_step(x, y)
    model.clip_grad_norm_(MAX_NORM)
    opt.step()
    return dp.stats.bytes_sent - before, sum(q.size for q in model.parameters())


def test_zero_sends_what_the_all_reduce_did(reference):
    """Reduce-scatter + all-gather of Ψ (even here: no padding) send the ring all-reduce's 2(p-1)/p·Ψ·b;
    ZeRO adds one float64 over dp, the clip's sum of squares. The pipeline's all-reduce is not also run."""
    config, init, _ = reference
    sent = {zero: ThreadWorld(2).run(bytes_on_dp_per_step, config, init, zero)[0] for zero in (0, 1, 2, 3)}
    psi = sent[0][1]
    assert psi % 2 == 0 and sent[0][0] == psi * 8 + 8             # the gradients' all-reduce, the loss's
    for zero in (1, 2, 3):
        assert sent[zero][0] == sent[0][0] + 8, zero


def test_bad_stages_are_clear_errors():
    mt.set_default_dtype(np.float64)
    config = nn.GPTConfig(**CONFIG)
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3, got 4"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, dp=2, zero=4))
    with pytest.raises(ValueError, match="ZeRO with pipedream_2bw"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, pp=2, schedule="pipedream_2bw",
                                              num_microbatches=2, zero=1))


JOB = ["--no-progress", "--precision", "fp64", "--steps", "12", "--n-embd", "32", "--block-size", "16",
       "--batch-size", "8", "--sample-chars", "1"]


def run_job(args, n, out):
    args = [*map(str, args), "--json", str(out)]
    if n == 1:
        assert gpt.main(args) == 0
    else:
        run_mpi([sys.executable, "-m", "minitrain.examples.gpt", *args], n=n, timeout=180)
    with open(out) as f:
        return json.load(f)


def assert_continues(report, reference_report):
    first, losses = report["first_step"], report["losses"]
    expected = reference_report["losses"][first:first + len(losses)]
    assert len(losses) == len(expected) > 0
    np.testing.assert_allclose(losses, expected, rtol=1e-10)


def keep_until(directory, step):
    import shutil
    for saved, _, path in checkpoint.list_checkpoints(directory):
        if saved > step:
            shutil.rmtree(path)


@pytest.mark.slow
def test_the_job_on_2_ranks_trains_as_one_process_on_half_the_optimizer_state(tmp_path):
    one = run_job(JOB, 1, tmp_path / "one.json")
    two = run_job(JOB + ["--dp", "2", "--zero", "2"], 2, tmp_path / "two.json")
    assert (two["zero"], two["strategy"], len(two["losses"])) == (2, "dp+zero2", 12)
    assert_continues(two, one)
    psi = one["num_params"]
    assert one["ranks"][0]["memory"]["persistent"]["optimizer_state"] == 2 * psi * 8
    for r in two["ranks"]:
        assert r["memory"]["persistent"]["optimizer_state"] == 2 * math.ceil(psi / 2) * 8
        assert r["memory"]["persistent"]["grads"] == math.ceil(psi / 2) * 8


@pytest.mark.slow
def test_the_job_resumes_across_zero_stages_and_layouts(tmp_path):
    """ZeRO-3 on dp 2 x tp 2 (shards cut across q, k, v) -> ZeRO-1 on dp 2 x pp 2 -> ZeRO-3 on dp 2 x pp 2 ->
    one process (--zero 2, dp 1), each resuming where the last one saved, as the uninterrupted run."""
    d = tmp_path / "ckpt"
    one = run_job(JOB, 1, tmp_path / "one.json")
    runs = [(["--dp", "2", "--tp", "2", "--zero", "3"], 4), (["--pp", "2", "--microbatches", "2", "--zero", "1"], 4),
            (["--pp", "2", "--microbatches", "2", "--zero", "3"], 4), (["--zero", "2"], 1)]
    for i, (flags, n) in enumerate(runs):
        report = run_job(JOB + flags + ["--save-dir", d, "--save-every", "3"] + (["--resume"] if i else []), n,
                         tmp_path / f"{i}.json")
        assert report["first_step"] == 3 * i and report["zero"] == int(flags[-1])
        assert_continues(report, one)
        for r in report["zero_memory"]["ranks"]:     # the ledger's optimizer state and gradients are the layout's
            assert r["measured"]["optimizer_state"] == r["expected"]["optimizer_state"]
            assert r["measured"]["grads"] == r["expected"]["grads"]
        keep_until(d, 3 * (i + 1))
    assert report["strategy"] == "single+zero2" and len(report["losses"]) == 3


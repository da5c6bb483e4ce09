"""A GPT with MoE layers on GPT3D (experts replicated on the tp ranks, ep = 1) trains as one process does:
float64, losses and parameters within 1e-10 relative, and the step's MoE figures (load_max_over_mean,
tokens dropped, balancing loss) gathered from every stage equal one process's, over tp, pp (GPipe,
1F1B, interleaved, zero-bubble; 2 and 4 micro-batches), tp x pp and dp x pp, dropless and with a
capacity factor counted over the same GShard groups (one process given moe_groups G = the run's), with
and without full recomputation, under context parallelism (each cp rank routes its own tokens; the
balancing loss's fractions and a capacity counted over every rank's; with ep, experts sharded too) and
under sequence parallelism (each tp rank routes its own piece of the sequence; with cp, over cp x tp).
In-process (ThreadWorld) for the model; the job's --json under mpiexec at 2 and 4 ranks against one
process's job; a checkpoint of tp x pp resumed in one process."""
import dataclasses
import json
import shutil
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.comm import ThreadWorld
from minitrain.parallel.gpt_3d import GPT3D
from minitrain.testing import run_mpi

STEPS = 10
CONFIG = dict(vocab_size=23, block_size=8, n_layer=2, n_head=4, n_embd=16, moe_experts=4, moe_top_k=2,
              moe_aux_loss_coef=0.05)


def data(B=8, T=8, steps=STEPS):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 23, (B, T)), rng.integers(0, 23, (B, T))) for _ in range(steps)]


def figures(model):
    """One process's step figures, as GPT3D.moe_statistics gives them."""
    stats = [block.mlp.statistics() for i, block in enumerate(model.h) if model.config.is_moe_layer(i)]
    return (max(s["load_max_over_mean"] for s in stats), sum(s["tokens_dropped"] for s in stats),
            sum(s["aux_loss"] for s in stats))


def reference_run(config, init, steps=STEPS, batch=8):
    model = nn.GPT(config)
    model.load_state_dict(init)
    opt = optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, stats = [], []
    for x, y in data(B=batch, steps=steps):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
        stats.append(figures(model))
    return model.state_dict(), losses, stats


def run_3d(comm, config, init, mesh, steps=STEPS, batch=8, **kwargs):
    mt.set_default_dtype(np.float64)
    gpt = nn.GPT(config)
    gpt.load_state_dict(init)
    model = GPT3D(gpt, comm, **mesh, **kwargs)
    opt = model.optimizer(optim.SGD, lr=0.5, momentum=0.9)          # with ZeRO, on this rank's shard
    losses, stats = [], []
    for x, y in data(B=batch, steps=steps):
        model.zero_grad()
        losses.append(model.train_step(x, y))
        stats.append(model.moe_statistics)
        model.clip_grad_norm_(0.5)
        opt.step()
    return model.full_state_dict(), losses, stats


CASES = {   # mesh, GPT3D's options, the config's moe fields (groups: a multiple of dp x micro-batches)
    "tp2": (dict(tp=2), dict(), {}),
    "pp2 1f1b m2": (dict(pp=2), dict(schedule="1f1b", num_microbatches=2), dict(moe_groups=2)),
    "pp2 gpipe m4 capacity": (dict(pp=2), dict(schedule="gpipe", num_microbatches=4),
                              dict(moe_groups=4, moe_capacity_factor=1.0)),
    "pp2 1f1b m4 groups 8": (dict(pp=2), dict(schedule="1f1b", num_microbatches=4), dict(moe_groups=8)),
    "tp2 pp2 m2": (dict(tp=2, pp=2), dict(schedule="1f1b", num_microbatches=2), dict(moe_groups=2)),
    "dp2 pp2 m2 capacity": (dict(dp=2, pp=2), dict(schedule="1f1b", num_microbatches=2),
                            dict(moe_groups=4, moe_capacity_factor=1.0)),
    "dp2 tp2 capacity every 2": (dict(dp=2, tp=2), dict(), dict(moe_groups=2, moe_capacity_factor=0.75,
                                                                moe_every=2)),
    "pp2 interleaved m2": (dict(pp=2), dict(schedule="interleaved_1f1b", num_microbatches=2, chunks=2),
                           dict(n_layer=4, moe_groups=2)),
    # zero-bubble: the aux loss's gradient reaches the router through the deferred weight gradients (W)
    "pp2 zb_h1 m2": (dict(pp=2), dict(schedule="zb_h1", num_microbatches=2), dict(moe_groups=2)),
    "pp2 zbv m2": (dict(pp=2), dict(schedule="zbv", num_microbatches=2, chunks=2), dict(n_layer=4, moe_groups=2)),
    # full recomputation (GPT3D's config only; the reference recomputes nothing)
    "pp2 1f1b m2 recompute full": (dict(pp=2), dict(schedule="1f1b", num_microbatches=2),
                                   dict(moe_groups=2, recompute="full")),
    "dp2 tp2 capacity recompute full": (dict(dp=2, tp=2), dict(), dict(moe_groups=2, moe_capacity_factor=1.0,
                                                                       recompute="full")),
    # context parallelism: each cp rank routes its own tokens; f and a capacity counted over the whole group
    "cp2 ring": (dict(cp=2), dict(), {}),
    "cp2 ring capacity": (dict(cp=2), dict(), dict(moe_capacity_factor=1.0)),
    "cp2 ulysses dp2 capacity groups 4": (dict(cp=2, dp=2), dict(cp_method="ulysses"),
                                          dict(moe_groups=4, moe_capacity_factor=0.75)),
    "cp2 ulysses dp2 zero2": (dict(cp=2, dp=2), dict(cp_method="ulysses", zero=2), dict(moe_groups=4)),
    "cp2 pp2 zb_h1 m2": (dict(cp=2, pp=2), dict(schedule="zb_h1", num_microbatches=2), dict(moe_groups=2)),
    # and the experts sharded over ep: the ep groups of every cp coordinate hold the same experts (expert-dp)
    "cp2 dp2 ep2 capacity": (dict(cp=2, dp=2), dict(ep=2), dict(moe_groups=2, moe_capacity_factor=1.0)),
    "cp2 ulysses dp2 ep2 zero1": (dict(cp=2, dp=2), dict(ep=2, cp_method="ulysses", zero=1), dict(moe_groups=2)),
    # sequence parallelism: each tp rank routes its own contiguous piece of the sequence; f, P and a capacity
    # counted over the group's tokens on every tp rank (with cp: on every cp x tp rank)
    "tp2 sp capacity": (dict(tp=2), dict(sequence_parallel=True), dict(moe_capacity_factor=1.0)),
    "dp2 tp2 sp capacity groups 4 recompute full": (dict(dp=2, tp=2), dict(sequence_parallel=True),
                                                    dict(moe_groups=4, moe_capacity_factor=0.75, recompute="full")),
    "tp2 pp2 sp zb_h1 m2 capacity": (dict(tp=2, pp=2), dict(sequence_parallel=True, schedule="zb_h1",
                                                            num_microbatches=2), dict(moe_groups=2, moe_capacity_factor=1.0)),
    "dp2 tp2 sp zero2 capacity": (dict(dp=2, tp=2), dict(sequence_parallel=True, zero=2),
                                  dict(moe_groups=2, moe_capacity_factor=1.0)),
    "cp2 tp2 sp ring capacity": (dict(cp=2, tp=2), dict(sequence_parallel=True), dict(moe_capacity_factor=1.0)),
    "cp2 ulysses tp2 sp capacity": (dict(cp=2, tp=2), dict(sequence_parallel=True, cp_method="ulysses"),
                                    dict(moe_capacity_factor=0.75)),
    "dp2 tp2 sp ep2 capacity": (dict(dp=2, tp=2), dict(sequence_parallel=True, ep=2),
                                dict(moe_groups=2, moe_capacity_factor=1.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_on_gpt3d_trains_as_one_process(case):
    assert_trains_as_one_process(*CASES[case])


def assert_trains_as_one_process(mesh, kwargs, moe):
    """GPT3D with experts on ``mesh`` (and GPT3D's ``kwargs``) == one process: losses, the step's MoE figures
    (load, tokens dropped, balancing loss) and the final parameters."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, **moe})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses, expected_stats = reference_run(dataclasses.replace(config, recompute=None), init)
    if moe.get("moe_capacity_factor"):
        assert sum(s[1] for s in expected_stats) > 0          # tokens were dropped: the groups matter
    size = mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1) * mesh.get("cp", 1)
    for state, losses, stats in ThreadWorld(size).run(run_3d, config, init, mesh, **kwargs):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10, atol=0)
        assert [s[1] for s in stats] == [s[1] for s in expected_stats]
        np.testing.assert_allclose([s[0] for s in stats], [s[0] for s in expected_stats], rtol=1e-12, atol=0)
        np.testing.assert_allclose([s[2] for s in stats], [s[2] for s in expected_stats], rtol=1e-10, atol=0)
        assert set(state) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_a_tp_rank_whose_every_choice_a_capacity_drops_runs_no_expert_and_trains_as_one_process():
    """Sequence parallelism on one row of 8 tokens: tp rank 0 holds positions 0-3, rank 1 positions 4-7. Top-1
    over 2 experts at capacity ceil(0.25 · 8 / 2) = 1: rank 0's tokens come first in the group's order, and where
    they choose both experts every choice of rank 1's tokens is dropped: rank 1 runs no expert (its (0, C) rows
    carry the graph), yet takes its part in the step's collectives, as one process trains."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, "moe_experts": 2, "moe_top_k": 1, "moe_capacity_factor": 0.25})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses, expected_stats = reference_run(config, init, batch=1)
    assert any(s[1] == 2 * 6 for s in expected_stats)   # both layers kept 2 of the 8 choices: rank 0's
    for state, losses, stats in ThreadWorld(2).run(run_3d, config, init, dict(tp=2), batch=1, sequence_parallel=True):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10, atol=0)
        assert [s[1] for s in stats] == [s[1] for s in expected_stats]
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("moe, recompute", [({}, None), ({"moe_capacity_factor": 1.0}, "full")],
                         ids=["dropless", "capacity recompute full"])
def test_under_sequence_parallelism_the_experts_draw_one_process_s_dropout_masks(moe, recompute):
    """Each tp rank holds some of an expert's rows; its dropout draws the mask of all the group's rows for that
    expert (one process's) and keeps its own, also for an expert with none here: the tp ranks' generators stay in
    step and the run is one process's (full recomputation replays the draws)."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, "dropout": 0.1, **moe})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    mt.manual_seed(1)
    expected, expected_losses, _ = reference_run(config, init)
    mt.manual_seed(1)                  # each ThreadWorld rank's generator starts from this state
    for state, losses, _ in ThreadWorld(2).run(run_3d, dataclasses.replace(config, recompute=recompute), init,
                                               dict(tp=2), sequence_parallel=True):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10, atol=0)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("recompute, sequence_parallel", [(None, False), ("full", False), (None, True),
                                                           ("full", True)])
def test_the_tensor_parallel_gpt_alone_adds_the_balancing_losses_to_its_loss_as_the_gpt_does(recompute,
                                                                                            sequence_parallel):
    """Outside GPT3D TensorParallelGPT's training loss is the GPT's: cross-entropy plus every MoE layer's
    aux_loss (with full recomputation its value, the gradient seeded in backward), and the router's
    gradient (whole on each tp rank) is the GPT's without recomputation. With sequence parallelism each tp
    rank routes its own tokens: the same loss on every rank, and the router's partial gradients summed over
    tp at the end of backward."""
    from minitrain.parallel.tensor_parallel import tensor_parallelize
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**CONFIG)
    gpt = nn.GPT(config)
    config = dataclasses.replace(config, recompute=recompute)
    x, y = data(steps=1)[0]
    loss = gpt(x, y)[1]
    loss.backward()

    def run(comm):
        mt.set_default_dtype(np.float64)
        copy = nn.GPT(config)
        copy.load_state_dict(gpt.state_dict())
        model = tensor_parallelize(copy, comm, sequence_parallel=sequence_parallel)
        tp_loss = model(x, y)[1]
        tp_loss.backward()
        return tp_loss.item(), [block.mlp.router.weight.grad for block in model.h]

    for value, grads in ThreadWorld(2).run(run):
        assert value == pytest.approx(loss.item(), rel=1e-12)
        for block, grad in zip(gpt.h, grads):
            np.testing.assert_allclose(grad, block.mlp.router.weight.grad, rtol=1e-10, atol=1e-14)


def test_one_process_with_full_recomputation_trains_as_without():
    """Each recomputed block computes its balancing loss without a graph in forward; AuxLossAutoScaler
    (scale 1) seeds its gradient when backward redoes the block: the same losses, figures, parameters."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, "moe_capacity_factor": 1.0, "moe_groups": 2})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses, expected_stats = reference_run(config, init)
    state, losses, stats = reference_run(dataclasses.replace(config, recompute="full"), init)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(stats, expected_stats, rtol=1e-10, atol=0)
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def idle_expert_gpt(config):
    """A GPT whose expert 3 only token 0 chooses: wte[0] is 10·d (d of zero mean and unit norm), so
    ln_2's output for token 0 lies along d; ln_2's bias 1 and expert 3's router row 100·d - 300/C give
    it the logit 100·d·ln_2(x) - 300: about +100 for token 0, below -200 for the others."""
    gpt = nn.GPT(config)
    C = config.n_embd
    d = np.where(np.arange(C) % 2, 1.0, -1.0) / np.sqrt(C)
    gpt.wte.weight.data[0] = 10 * d
    for block in gpt.h:
        block.ln_2.bias.data[...] = 1.0
        block.mlp.router.weight.data[3] = 100 * d - 300 / C
    return gpt


def idle_expert_grads(comm, config, init, x, y):
    mt.set_default_dtype(np.float64)
    gpt = nn.GPT(config)
    gpt.load_state_dict(init)
    model = GPT3D(gpt, comm, dp=2)
    model.train_step(x, y)
    return {n: None if q.grad is None else q.grad.copy() for n, q in model.pipe.named_parameters()}


@pytest.mark.parametrize("token_0_on", ["no replica", "replica 0"])
def test_an_expert_some_replicas_leave_idle_is_reduced_and_one_none_use_keeps_no_gradient(token_0_on):
    """Without find_unused_parameters the replicas would reduce different lists of gradients; an expert
    that no token chose keeps grad None (AdamW then leaves it alone, as one process does)."""
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, "moe_groups": 2})
    init = {k: v.copy() for k, v in idle_expert_gpt(config).state_dict().items()}
    x = np.random.default_rng(1).integers(1, 23, (8, 8))
    if token_0_on == "replica 0":
        x[1, 3] = 0                                      # rows 0-3 are replica 0's
    one = nn.GPT(config)
    one.load_state_dict(init)
    one(x, x)[1].backward()
    idle = {f"{i + 1}.mlp.experts.3.{layer}.{kind}" for i in (0, 1) for layer in ("c_fc", "c_proj")
            for kind in ("weight", "bias")}
    expected = idle if token_0_on == "no replica" else set()
    assert {f"{i + 1}.{n}" for i in (0, 1) for n, q in one.h[i].named_parameters() if q.grad is None} == expected
    for grads in ThreadWorld(2).run(idle_expert_grads, config, init, x, x):
        assert {n for n, g in grads.items() if g is None} == expected
        for i in (0, 1):
            for name, q in one.h[i].named_parameters():
                if q.grad is not None:
                    np.testing.assert_allclose(grads[f"{i + 1}.{name}"], q.grad, rtol=1e-10, atol=1e-14)


def test_groups_that_micro_batches_would_split_are_clear_errors():
    mt.set_default_dtype(np.float64)
    config = nn.GPTConfig(**{**CONFIG, "moe_groups": 2})
    with pytest.raises(ValueError, match=r"moe_groups 2 is not a multiple of dp x micro-batches = 1 x 4"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, pp=2, num_microbatches=4))
    with pytest.raises(ValueError, match=r"a batch of 5 rows does not split into moe_groups 2 groups"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, tp=2, num_microbatches=2).train_step(
            *[a[:5] for a in data(steps=1)[0]]))


# ---- the job: mpiexec at 2 and 4 ranks against one process's job given the run's --moe-groups
JOB = ["--no-progress", "--precision", "fp64", "--n-layer", 2, "--n-embd", 32, "--n-head", 2, "--block-size", 16,
       "--batch-size", 4, "--sample-chars", 4, "--steps", STEPS, "--moe-experts", 4, "--moe-top-k", 2]
CAPACITY = ["--moe-capacity-factor", 1.0]
JOBS = {   # name: (ranks, options, the one-process run's --moe-groups: dp x micro-batches)
    "tp2": (2, ["--tp", 2], 1),
    "pp2 1f1b m2": (2, ["--pp", 2, "--microbatches", 2], 2),
    "pp2 1f1b m2 recompute full": (2, ["--pp", 2, "--microbatches", 2, "--recompute", "full"], 2),
    "pp2 gpipe m4 capacity": (2, ["--pp", 2, "--schedule", "gpipe", "--microbatches", 4] + CAPACITY, 4),
    "tp2 pp2 m2": (4, ["--tp", 2, "--pp", 2, "--microbatches", 2], 2),
    "dp2 pp2 m2 capacity": (4, ["--pp", 2, "--microbatches", 2] + CAPACITY, 4),
    "tp2 sp capacity": (2, ["--tp", 2, "--sequence-parallel"] + CAPACITY, 1),
    "tp2 pp2 sp m2 recompute full": (4, ["--tp", 2, "--pp", 2, "--sequence-parallel", "--microbatches", 2,
                                         "--recompute", "full"], 2),
}


@pytest.fixture(scope="module")
def job_reports(tmp_path_factory):
    """Every JOBS run, one mpiexec launch per world size (the runs one after another in it)."""
    d = tmp_path_factory.mktemp("moe3d")
    for ranks in (2, 4):
        runs = [([str(a) for a in JOB + options] + ["--json", str(d / f"{name}.json")])
                for name, (n, options, _) in JOBS.items() if n == ranks]
        script = f"from minitrain.examples import gpt\nfor argv in {runs!r}:\n    assert gpt.main(argv) == 0, argv"
        run_mpi([sys.executable, "-c", script], n=ranks, timeout=600)
    return {name: json.loads((d / f"{name}.json").read_text()) for name in JOBS}


@pytest.mark.parametrize("name", list(JOBS))
def test_the_job_under_mpiexec_equals_one_process_given_its_groups(name, job_reports, tmp_path):
    from minitrain.examples import gpt
    from test_resume_guards import run
    ranks, options, groups = JOBS[name]
    report = job_reports[name]
    assert report["world_size"] == ranks
    out = tmp_path / "one.json"
    extra = CAPACITY if "capacity" in name else []
    status, _, err = run(gpt, JOB + extra + ["--moe-groups", groups, "--json", out])
    assert status == 0, err
    one = json.loads(out.read_text())
    assert len(report["losses"]) == len(one["losses"]) == STEPS
    np.testing.assert_allclose(report["losses"], one["losses"], rtol=1e-10, atol=0)
    assert set(report["moe"]) == set(one["moe"]) == {"load_max_over_mean", "tokens_dropped", "aux_loss"}
    np.testing.assert_allclose(report["moe"]["aux_loss"], one["moe"]["aux_loss"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(report["moe"]["load_max_over_mean"], one["moe"]["load_max_over_mean"], rtol=1e-12,
                               atol=0)
    assert report["moe"]["tokens_dropped"] == one["moe"]["tokens_dropped"]
    assert (report["moe"]["tokens_dropped"] > 0) == bool(extra)
    if "sp" in name.split():     # Megatron's bytes per block as counted; the experts' routing apart
        assert report["bytes_per_layer_forward"] == report["bytes_per_layer_forward_formula"] > 0
    if name == "tp2 sp capacity":   # per MoE layer: P and the counts (4 x fp64 each), the 4 x 8 tokens' 2 choices
        assert report["experts_sp_bytes_per_step"] == 2 * (4 * 8 + 4 * 8 + 4 * 8 * 2 * 8)


@pytest.mark.parametrize("extra, needle", [
    (["--microbatches", 2, "--moe-groups", 1], "--moe-groups 1 is not a multiple of the 1 data-parallel replicas x 2 "
                                               "micro-batches"),
])
def test_refused_in_one_line(extra, needle):
    from minitrain.examples import gpt
    from test_resume_guards import refused
    refused(gpt, JOB + extra, needle)


def test_a_checkpoint_of_tp2_x_pp2_with_experts_resumes_in_one_process(tmp_path):
    """Each rank saves its stage's experts (whole on every tp rank: written once); one process given the
    run's --moe-groups resumes at step 3 and trains steps 4-6 with the uninterrupted run's losses."""
    from minitrain.examples import gpt
    from test_resume_guards import run
    argv = [str(a) for a in JOB[:-6] + ["--steps", 6, "--moe-experts", 4, "--moe-top-k", 2, "--moe-every", 2]]
    d = tmp_path / "ckpt"
    script = (f"from minitrain.examples import gpt; assert gpt.main({argv!r} + ['--tp', '2', '--pp', '2', "
              f"'--microbatches', '2', '--save-dir', {str(d)!r}, '--save-every', '3']) == 0")
    run_mpi([sys.executable, "-c", script], n=4, timeout=300)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) == ["step-00000003", "step-00000006"]
    shutil.rmtree(d / "step-00000006")
    resumed, whole = tmp_path / "resumed.json", tmp_path / "whole.json"
    status, _, err = run(gpt, argv + ["--moe-groups", 2, "--save-dir", d, "--resume", "--json", resumed])
    assert status == 0, err
    assert run(gpt, argv + ["--moe-groups", 2, "--json", whole])[0] == 0
    resumed, whole = json.loads(resumed.read_text()), json.loads(whole.read_text())
    assert resumed["first_step"] == 3
    np.testing.assert_allclose(resumed["losses"], whole["losses"][3:], rtol=1e-10, atol=0)

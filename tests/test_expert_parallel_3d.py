"""Expert parallelism inside GPT3D (--ep with dp x pp x tp; parallel/expert_parallel_3d.py) trains as one
process does: float64, losses, the step's MoE figures and the parameters within 1e-10 relative over 10
steps, one process given the run's moe_groups. In-process (ThreadWorld): dp x tp, dp x pp (1F1B, the
zero-bubble schedules), ep = dp and ep < dp (an expert data-parallel group of 2), top-1 with a capacity
factor, full recomputation; ZeRO 1-3 with experts (ep 1: idle experts left alone as AdamW does in one
process; ep 2: the experts' ZeRO over their expert data-parallel group); under mpiexec the job's --json at
4 ranks (and one run at 8: dp2 x pp2 x tp2 --ep 2 --zero 1) against one process's job, its all-to-all
bytes measured equal to the formula from the split sizes."""
import json
import shutil
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.comm import ThreadWorld
from minitrain.parallel.expert_parallel_3d import ExpertParallelReplicatedMoE
from minitrain.parallel.gpt_3d import GPT3D
from minitrain.testing import run_mpi

from test_moe_3d import CONFIG, assert_trains_as_one_process, data

CASES = {   # mesh, GPT3D's options, the config's moe fields (groups: a multiple of dp x micro-batches)
    "dp2 tp2 ep2": (dict(dp=2, tp=2), dict(ep=2), dict(moe_groups=2)),
    "dp2 pp2 ep2 1f1b m2": (dict(dp=2, pp=2), dict(ep=2, schedule="1f1b", num_microbatches=2), dict(moe_groups=4)),
    "dp4 ep2 capacity top-1": (dict(dp=4), dict(ep=2), dict(moe_groups=4, moe_top_k=1, moe_capacity_factor=1.0)),
    "dp4 ep4 every 2": (dict(dp=4), dict(ep=4), dict(moe_groups=4, moe_every=2)),
    "dp2 pp2 ep2 every 2 m2": (dict(dp=2, pp=2), dict(ep=2, num_microbatches=2), dict(moe_groups=4, moe_every=2)),
    "dp2 pp2 ep2 interleaved m2": (dict(dp=2, pp=2), dict(ep=2, schedule="interleaved_1f1b", num_microbatches=2,
                                                          chunks=2), dict(n_layer=4, moe_groups=4)),
    "dp2 pp2 ep2 zb_h1 m2": (dict(dp=2, pp=2), dict(ep=2, schedule="zb_h1", num_microbatches=2), dict(moe_groups=4)),
    "dp2 pp2 ep2 zbv m2": (dict(dp=2, pp=2), dict(ep=2, schedule="zbv", num_microbatches=2, chunks=2),
                           dict(n_layer=4, moe_groups=4)),
    "dp2 tp2 ep2 capacity recompute full": (dict(dp=2, tp=2), dict(ep=2),
                                            dict(moe_groups=2, moe_capacity_factor=1.0, recompute="full")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_gpt3d_trains_as_one_process(case):
    assert_trains_as_one_process(*CASES[case])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_on_the_gpu_a_rank_that_counts_no_gradient_in_the_norm_clips_as_the_cpu_does(standin_gpu, sequence_parallel):
    """dp2 x tp2, ep 2 on the (strict) CuPy stand-in: tp rank 1 of ep rank 1 counts neither the experts (tp rank 0
    counts them) nor the dense parameters (ep rank 0 does); its zero must be on the device, as the other ranks'
    sums are, or the norm's all-reduce mixes a host array with device ones. Two steps == the CPU's, with and
    without sequence parallelism (each tp rank routing its own tokens)."""
    from minitrain import backend
    from test_moe_3d import run_3d
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, "moe_groups": 2, "moe_capacity_factor": 1.0})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    mesh, options = dict(dp=2, tp=2), dict(ep=2, sequence_parallel=sequence_parallel)
    gpu = ThreadWorld(4).run(run_3d, config, init, mesh, 2, **options)
    backend.set_device("cpu")
    cpu = ThreadWorld(4).run(run_3d, config, init, mesh, 2, **options)
    for (_, on_gpu, _), (_, on_cpu, _) in zip(gpu, cpu):
        np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-12, atol=0)


def test_the_layers_hold_their_experts_under_global_names_and_the_ep_group_stays_in_a_stage_and_tp_coordinate():
    """dp2 x tp2, ep 2: rank (d, t) holds experts 2d, 2d + 1 named experts.2d..., its ep group the ranks
    (0, t) and (1, t): the same tp coordinate, consecutive dp replicas."""
    mt.set_default_dtype(np.float64)
    config = nn.GPTConfig(**{**CONFIG, "moe_groups": 2})

    def build(comm):
        model = GPT3D(nn.GPT(config), comm, dp=2, tp=2, ep=2)
        layer = model.model.h[0].mlp
        names = sorted({n.split(".")[1] for n, _ in layer.named_parameters() if n.startswith("experts.")})
        return (isinstance(layer, ExpertParallelReplicatedMoE), names, model.ep_comm.size, model.ep_comm.rank,
                model.mesh.coordinate("tp"), model.expert_dp_comm.size)
    for rank, (sharded, names, size, ep_rank, t, expert_dp) in enumerate(ThreadWorld(4).run(build)):
        d = rank // 2
        assert sharded and names == [str(2 * d), str(2 * d + 1)] and (size, ep_rank, t, expert_dp) == (2, d, rank % 2, 1)


def test_ep_refusals_are_clear_errors():
    mt.set_default_dtype(np.float64)
    config = nn.GPTConfig(**{**CONFIG, "moe_groups": 2})
    with pytest.raises(ValueError, match=r"ep=2 must divide the 1 data-parallel ranks"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(config), comm, tp=2, ep=2))
    with pytest.raises(ValueError, match=r"ep = 2 but the GPT has no MoE layer"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(nn.GPTConfig(**{**CONFIG, "moe_experts": 0})), comm, dp=2,
                                              ep=2))


# ---- the job: mpiexec at 4 ranks against one process's job given the run's --moe-groups
JOB = ["--no-progress", "--precision", "fp64", "--n-layer", 2, "--n-embd", 32, "--n-head", 2, "--block-size", 16,
       "--batch-size", 4, "--sample-chars", 4, "--steps", 10, "--moe-experts", 4]
TOP1_CAPACITY = ["--moe-top-k", 1, "--moe-capacity-factor", 1.0]
JOBS = {   # name: (ranks, options, the one-process run's options: --moe-groups dp x micro-batches)
    "dp2 tp2 ep2": (4, ["--tp", 2, "--ep", 2], ["--moe-groups", 2]),
    "dp2 pp2 ep2 1f1b m2": (4, ["--pp", 2, "--microbatches", 2, "--ep", 2], ["--moe-groups", 4]),
    "dp2 tp2 ep2 top-1 capacity": (4, ["--tp", 2, "--ep", 2] + TOP1_CAPACITY, ["--moe-groups", 2] + TOP1_CAPACITY),
    # ZeRO with experts at ep = 1 (an expert some step leaves idle keeps its AdamW state, as in one process)
    "dp2 tp2 zero1": (4, ["--tp", 2, "--zero", 1], ["--moe-groups", 2]),
    "dp2 pp2 zero3 1f1b m2": (4, ["--pp", 2, "--microbatches", 2, "--zero", 3], ["--moe-groups", 4]),
    "dp2 tp2 ep2 zero1": (4, ["--tp", 2, "--ep", 2, "--zero", 1], ["--moe-groups", 2]),
    "dp2 pp2 ep2 zero3 1f1b m2": (4, ["--pp", 2, "--microbatches", 2, "--ep", 2, "--zero", 3], ["--moe-groups", 4]),
    # the one 8-rank run: every axis at once
    "dp2 pp2 tp2 ep2 zero1 1f1b m2": (8, ["--tp", 2, "--pp", 2, "--microbatches", 2, "--ep", 2, "--zero", 1],
                                      ["--moe-groups", 4]),
}


@pytest.fixture(scope="module")
def job_reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep3d")
    for ranks in sorted({n for n, *_ in JOBS.values()}):
        runs = [([str(a) for a in JOB + options] + ["--json", str(d / f"{name}.json")])
                for name, (n, options, _) in JOBS.items() if n == ranks]
        script = f"from minitrain.examples import gpt\nfor argv in {runs!r}:\n    assert gpt.main(argv) == 0, argv"
        run_mpi([sys.executable, "-c", script], n=ranks, timeout=600)
    return {name: json.loads((d / f"{name}.json").read_text()) for name in JOBS}


@pytest.mark.parametrize("name", list(JOBS))
def test_the_job_under_mpiexec_equals_one_process_and_measures_the_formulas_all_to_all_bytes(name, job_reports,
                                                                                             tmp_path):
    from minitrain.examples import gpt
    from test_resume_guards import run
    ranks, options, one_options = JOBS[name]
    report = job_reports[name]
    ep = 2 if "ep2" in name else 1
    assert report["world_size"] == ranks and report["ep"] == ep and report["zero"] == (3 if "zero3" in name else
                                                                                       1 if "zero1" in name else 0)
    out = tmp_path / "one.json"
    status, _, err = run(gpt, JOB + one_options + ["--json", out])
    assert status == 0, err
    one = json.loads(out.read_text())
    assert len(report["losses"]) == len(one["losses"]) == 10
    np.testing.assert_allclose(report["losses"], one["losses"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(report["moe"]["aux_loss"], one["moe"]["aux_loss"], rtol=1e-10, atol=0)
    assert report["moe"]["tokens_dropped"] == one["moe"]["tokens_dropped"]
    assert (report["moe"]["tokens_dropped"] > 0) == ("capacity" in name)
    assert (report["all_to_all_bytes_per_step"] > 0) == (ep > 1)
    assert report["all_to_all_bytes_per_step"] == report["all_to_all_bytes_formula"]


# ---- ZeRO on dp with experts (ep = 1): exact while every expert gets a token each step, else refused
def run_zero(comm, config, init, mesh, steps=10, **kwargs):
    mt.set_default_dtype(np.float64)
    gpt = nn.GPT(config)
    gpt.load_state_dict(init)
    model = GPT3D(gpt, comm, **mesh, **kwargs)
    opt = model.optimizer(optim.AdamW, lr=0.05, weight_decay=0.1)
    losses = []
    for x, y in data(steps=steps):
        model.zero_grad()
        losses.append(model.train_step(x, y))
        model.clip_grad_norm_(0.5)
        opt.step()
    return model.full_state_dict(), losses


def adamw_reference(config, init, steps=10):
    model = nn.GPT(config)
    model.load_state_dict(init)
    opt = optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses, idle = [], 0
    for x, y in data(steps=steps):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        idle += sum(q.grad is None for q in model.parameters())
        optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses, idle


ZERO_CASES = {   # mesh, GPT3D's options, the config's moe fields
    "dp2 zero1": (dict(dp=2), dict(zero=1), dict(moe_groups=2)),
    "dp2 tp2 zero2 top-1 capacity": (dict(dp=2, tp=2), dict(zero=2),
                                     dict(moe_groups=4, moe_top_k=1, moe_capacity_factor=1.0)),
    "dp2 pp2 zero3 1f1b m2": (dict(dp=2, pp=2), dict(zero=3, schedule="1f1b", num_microbatches=2),
                              dict(moe_groups=4)),
    # ep 2: the experts' ZeRO over the expert data-parallel group (its mean / ep), the dense one over dp
    "dp2 tp2 ep2 zero1": (dict(dp=2, tp=2), dict(zero=1, ep=2), dict(moe_groups=2)),
    "dp4 ep2 zero2 top-1 capacity": (dict(dp=4), dict(zero=2, ep=2),
                                     dict(moe_groups=4, moe_top_k=1, moe_capacity_factor=1.0)),
    "dp2 pp2 ep2 zero3 1f1b m2": (dict(dp=2, pp=2), dict(zero=3, ep=2, schedule="1f1b", num_microbatches=2),
                                  dict(moe_groups=4)),
    "dp2 pp2 ep2 zero1 every 2 m2": (dict(dp=2, pp=2), dict(zero=1, ep=2, num_microbatches=2),   # a stage without experts
                                     dict(moe_groups=4, moe_every=2)),
}


@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_zero_with_experts_trains_as_one_process_whose_idle_experts_adamw_skips(case):
    """AdamW with weight decay: the experts no token chose in a step (grad None in one process) take no
    step there, nor in the ZeRO shard (its per-parameter pieces)."""
    mesh, kwargs, moe = ZERO_CASES[case]
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**{**CONFIG, **moe})
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses, idle = adamw_reference(config, init)
    assert idle > 0                                           # some expert idled in some step
    size = mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1)
    for state, losses in ThreadWorld(size).run(run_zero, config, init, mesh, **kwargs):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10, atol=0)
        for name, value in expected.items():      # atol: the key bias's gradient is rounding noise (its true
            # gradient is 0), which AdamW normalises into steps of ~1e-12
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-10, err_msg=name)


# ---- checkpoints: each rank saves its experts under their global names; any layout resumes
CKPT = [str(a) for a in JOB[:-4] + ["--steps", 6, "--moe-experts", 4, "--lr", 0.05]]


def checkpoint_then_resume(tmp_path, ranks, options, one_options):
    """Save at steps 3 and 6 on ``ranks`` ranks, drop step 6; return the uninterrupted one-process run's
    report and a function that resumes the checkpoint (in one process or under mpiexec) and reads its report."""
    from minitrain.examples import gpt
    from test_resume_guards import run
    d = tmp_path / "ckpt"
    script = (f"from minitrain.examples import gpt; assert gpt.main({CKPT + options!r} + ['--save-dir', {str(d)!r}, "
              f"'--save-every', '3']) == 0")
    run_mpi([sys.executable, "-c", script], n=ranks, timeout=300)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) == ["step-00000003", "step-00000006"]
    shutil.rmtree(d / "step-00000006")
    whole = tmp_path / "whole.json"
    assert run(gpt, CKPT + one_options + ["--json", whole])[0] == 0

    def resume(n, resume_options, name):
        out = tmp_path / f"{name}.json"
        argv = CKPT + resume_options + ["--save-dir", str(d), "--resume", "--json", str(out)]
        if n == 1:
            status, _, err = run(gpt, argv)
            assert status == 0, err
        else:
            run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; assert gpt.main({argv!r}) == 0"],
                    n=n, timeout=300)
        shutil.rmtree(d / "step-00000006")          # what this resumed run saved: the next one resumes at 3 too
        return json.loads(out.read_text())
    return json.loads(whole.read_text()), resume


def test_a_checkpoint_of_dp2_x_tp2_ep2_resumes_in_one_process_and_on_dp2_ep2_with_and_without_zero(tmp_path):
    """Under --ep with --zero the dense parameters and the experts are two optimizers: a checkpoint without ZeRO
    holds one optimizer's scheduler (one learning rate per group of one process), which must still set both."""
    whole, resume = checkpoint_then_resume(tmp_path, 4, ["--tp", "2", "--ep", "2"], ["--moe-groups", "2"])
    for n, options, name in ((1, ["--moe-groups", "2"], "one"), (2, ["--ep", "2"], "dp2 ep2"),
                             (2, ["--ep", "2", "--zero", "1"], "dp2 ep2 zero1")):
        resumed = resume(n, options, name)
        assert resumed["first_step"] == 3
        np.testing.assert_allclose(resumed["losses"], whole["losses"][3:], rtol=1e-10, atol=0, err_msg=name)


@pytest.mark.parametrize("zero", ["1", "3"])
def test_a_zero_checkpoint_with_experts_resumes_in_one_process(tmp_path, zero):
    """ZeRO's per-parameter pieces each save their own AdamW state (an idle expert's: none, as in one process)."""
    whole, resume = checkpoint_then_resume(tmp_path, 2, ["--zero", zero], ["--moe-groups", "2"])
    resumed = resume(1, ["--moe-groups", "2"], "one")
    assert resumed["first_step"] == 3
    np.testing.assert_allclose(resumed["losses"], whole["losses"][3:], rtol=1e-10, atol=0)


def test_a_checkpoint_of_ep2_with_zero_3_resumes_in_one_process_and_under_ep2_zero_1(tmp_path):
    """The experts' ZeRO and the dense parameters' save as one optimizer (its shards cut across the logical
    tensors, each expert under its global name) and load back into either, or into one process's AdamW."""
    whole, resume = checkpoint_then_resume(tmp_path, 4, ["--ep", "2", "--zero", "3"], ["--moe-groups", "4"])
    for n, options, name in ((1, ["--moe-groups", "4"], "one"), (2, ["--ep", "2", "--zero", "1", "--moe-groups", "4"],
                                                                  "dp2 ep2 zero1")):
        resumed = resume(n, options, name)
        assert resumed["first_step"] == 3
        np.testing.assert_allclose(resumed["losses"], whole["losses"][3:], rtol=1e-10, atol=0, err_msg=name)


def test_an_overflow_in_the_experts_gradients_alone_skips_both_parts_of_the_step():
    """fp16 with ZeRO and ep (ExpertZero: the dense shard's optimizer beside the experts'): an inf in the experts'
    gradient shard on one rank skips the step of both parts on every rank, and both halve the one loss scale
    (found_inf(also=...)); a verdict from the dense gradients alone would step the experts' masters into inf."""
    config = nn.GPTConfig(**{**CONFIG, "moe_groups": 2})

    def run(comm):
        mt.manual_seed(0)
        model = GPT3D(nn.GPT(config).to(np.float16), comm, dp=2, ep=2, zero=1)
        opt = model.optimizer(optim.AdamW, lr=0.01, init_scale=8.0)
        x, y = next(iter(data(steps=1)))
        before = [q.data.copy() for q in model.parameters()]
        model.zero_grad()
        model.train_step(x, y)
        if comm.rank == 1:                  # the experts' shard, as it stands after the reduce-scatter
            next(q for q in model.zero.inners[1].params if q.grad is not None).grad[...] = np.inf
        opt.step()
        unchanged = all(np.array_equal(q.data, b) for q, b in zip(model.parameters(), before))
        return unchanged, [o.loss_scale for o in model.zero.inners], [o.skipped_steps for o in model.zero.inners]
    for unchanged, scales, skipped in ThreadWorld(2).run(run):
        assert unchanged and scales == [4.0, 4.0] and skipped == [1, 1], (unchanged, scales, skipped)

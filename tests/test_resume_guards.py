"""A resume never guesses (examples/checkpointing.py): step folders that lost their manifest are refused by
name, a save never writes into an existing step folder, another architecture is refused by name (a resume
and generate --checkpoint), and a resume whose schedule, learning rate or seed differ from the checkpoint's
stops unless --override-opt-param-scheduler or --use-checkpoint-opt-param-scheduler says which to take; with
the override, --steps 16 after an 8-step cosine run decays over 16 steps. One process, a small GPT."""
import contextlib
import io
import json
import os
import sys

import pytest

from minitrain import checkpoint
from minitrain.data import load_digits
from minitrain.examples import generate, gpt, mlp
from minitrain.optim.lr_scheduler import warmup_cosine
from minitrain.testing import run_mpi

GPT = ["--no-progress", "--precision", "fp64", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
       "--sample-chars", "1", "--n-layer", "1"]
OVERRIDE, USE_CHECKPOINT = "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"


def run(job, argv):
    """(exit status, stdout, stderr) of a job run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = job.main([str(a) for a in argv])
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


@pytest.fixture
def saved(tmp_path):
    """An 8-step cosine GPT run saved at steps 4 and 8."""
    d = tmp_path / "ckpt"
    assert run(gpt, GPT + ["--steps", 8, "--save-dir", d, "--save-every", 4])[0] == 0
    return d


def refused(job, argv, *needles):
    status, _, err = run(job, argv)
    assert status == 2 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_step_folders_without_a_manifest_are_refused_by_name_and_left_alone(saved):
    for step in ("step-00000004", "step-00000008"):
        os.remove(saved / step / "manifest.json")
    refused(gpt, GPT + ["--steps", 8, "--save-dir", saved, "--resume"],
            "step-00000004, step-00000008 have no manifest.json")
    assert sorted(os.listdir(saved)) == ["step-00000004", "step-00000008"]
    assert not (saved / "step-00000008" / "manifest.json").exists()          # nothing was written into them


def test_a_save_never_writes_into_an_existing_step_folder(saved):
    before = checkpoint.read_manifest(saved / "step-00000004")
    refused(gpt, GPT + ["--steps", 8, "--save-dir", saved, "--save-every", 4],
            f"--save-dir {saved} already holds step-00000004, step-00000008: give --resume")
    assert checkpoint.read_manifest(saved / "step-00000004") == before


def test_another_architecture_is_refused_by_name(saved):
    refused(gpt, GPT + ["--steps", 8, "--save-dir", saved, "--resume", "--n-head", 2],
            "n_head = 4 (--n-head), this one 2: another architecture")
    # named before the settings that differ too: no override could make the checkpoint fit
    err = refused(gpt, GPT + ["--steps", 16, "--lr", "1e-3", "--save-dir", saved, "--resume", "--n-layer", 2],
                  "n_layer = 1 (--n-layer), this one 2: another architecture")
    assert "--lr" not in err.splitlines()[-1], err
    def serve(context=16):
        return ["--checkpoint", saved, "--n-layer", 1, "--n-embd", 32, "--context", context, "--max-prompt-len", 8,
                "--max-new-tokens", 4, "--num-prompts", 2]
    refused(generate, serve() + ["--n-head", 2], "n_head = 4 (--n-head), this one 2")
    refused(generate, serve(32), "block_size = 16 (--context), this one 32")
    assert run(generate, serve())[0] == 0


@pytest.mark.parametrize("change, named", [(["--steps", 16], "--steps 8 (this command line: 16)"),
                                           (["--lr", "1e-3"], "--lr 0.003 (this command line: 0.001)"),
                                           (["--lr-schedule", "constant"], "--lr-schedule cosine (this command line: constant)"),
                                           (["--warmup-steps", 3], "--warmup-steps 0 (this command line: 3)"),
                                           (["--seed", 7], "--seed 0 (this command line: 7)")],
                         ids=["steps", "lr", "lr-schedule", "warmup", "seed"])
def test_other_settings_stop_a_resume_unless_an_option_says_which_to_take(saved, change, named):
    argv = GPT + ["--steps", 8, "--save-dir", saved, "--resume"] + change
    refused(gpt, argv, named, OVERRIDE, USE_CHECKPOINT)
    for option in (OVERRIDE, USE_CHECKPOINT):
        keep_until(saved, 4)
        status, out, err = run(gpt, argv + [option, "--json", saved.parent / "r.json"])
        assert status == 0, err
        assert json.loads((saved.parent / "r.json").read_text())["first_step"] == 4


def test_fp16_s_init_scale_is_a_setting_a_resume_compares(tmp_path):
    """The loss scale a resume continues with is the checkpoint's: another --init-scale is refused by name (not
    silently dropped), the override restarts the scale at it, the checkpoint's option keeps the saved one."""
    d, fp16 = tmp_path / "ckpt", GPT + ["--precision", "fp16", "--steps", 4, "--json", tmp_path / "r.json"]
    assert run(gpt, fp16 + ["--steps", 2, "--init-scale", 2 ** 20, "--save-dir", d])[0] == 0   # 2 skipped: 2^18
    refused(gpt, fp16 + ["--save-dir", d, "--resume"], "--init-scale 1048576.0 (this command line: 65536.0)",
            OVERRIDE, USE_CHECKPOINT)
    # from 8 no step overflows; from the saved 2^18 the third step overflows too (as it did in one run): 2^17
    for option, scale, skipped in ((OVERRIDE, 8.0, 2), (USE_CHECKPOINT, 2.0 ** 17, 3)):
        keep_until(d, 2)
        status, _, err = run(gpt, fp16 + ["--save-dir", d, "--resume", "--init-scale", 8, option])
        assert status == 0, err
        report = json.loads((tmp_path / "r.json").read_text())
        assert (report["first_step"], report["loss_scale"], report["skipped_steps"]) == (2, scale, skipped)


def test_the_override_restarts_the_experts_loss_scale_too(tmp_path):
    """fp16 with ZeRO and ep: the dense shard's and the experts' optimizers keep one loss scale. The override's
    --init-scale restarted the dense one's alone: the experts' gradients, scaled by the new scale, were unscaled
    by the saved one (the next loss 2e-4 off, silently). Against the same resume without ZeRO (one optimizer)."""
    job = [sys.executable, "-m", "minitrain.examples.gpt", "--no-progress", "--n-layer", 2, "--n-embd", 16,
           "--n-head", 2, "--block-size", 8, "--batch-size", 4, "--sample-chars", 0, "--lr", 0.01, "--precision",
           "fp16", "--moe-experts", 4, "--moe-aux-loss-coef", 1.0, "--ep", 2]
    reports = {}
    for name, zero in (("zero1", ["--zero", 1]), ("one optimizer", [])):
        d = tmp_path / name.replace(" ", "_")
        run_mpi(job + zero + ["--steps", 2, "--init-scale", 2 ** 20, "--save-dir", d], n=2, timeout=120)
        run_mpi(job + zero + ["--steps", 4, "--init-scale", 8, "--save-dir", d, "--resume", OVERRIDE,
                              "--json", d / "r.json"], n=2, timeout=120)
        reports[name] = json.loads((d / "r.json").read_text())
    assert (reports["zero1"]["first_step"], reports["zero1"]["loss_scale"]) == (2, 8.0)
    assert reports["zero1"]["losses"] == reports["one optimizer"]["losses"]


def keep_until(directory, step):
    for saved, _, path in checkpoint.list_checkpoints(directory):
        if saved > step:
            for name in os.listdir(path):
                os.remove(os.path.join(path, name))
            os.rmdir(path)


def schedule_at(directory, step):
    return checkpoint.read_manifest(directory / f"step-{step:08d}")["scalars"]["scheduler"]


def test_extending_a_run_with_the_override_decays_over_the_new_steps(saved):
    status, _, err = run(gpt, GPT + ["--steps", 16, "--save-dir", saved, "--save-every", 4, "--resume", OVERRIDE])
    assert status == 0, err
    state = schedule_at(saved, 12)
    assert state["lr_lambdas"][0]["total_steps"] == 16 and state["lr_lambdas"][0]["warmup_steps"] == 1
    assert state["_last_lr"][0] == pytest.approx(3e-3 * warmup_cosine(1, 16)(12), rel=1e-12)
    assert checkpoint.read_manifest(saved / "step-00000016")["scalars"]["job"]["training"]["steps"] == 16


def test_the_checkpoint_s_schedule_when_asked(saved):
    status, _, err = run(gpt, GPT + ["--steps", 16, "--save-dir", saved, "--save-every", 4, "--resume",
                                     "--lr", "1e-2", USE_CHECKPOINT])
    assert status == 0, err
    state = schedule_at(saved, 12)                   # the old 8-step schedule, at its floor: lr / 10
    assert state["lr_lambdas"][0]["total_steps"] == 8 and state["_last_lr"][0] == pytest.approx(3e-4, rel=1e-12)
    assert checkpoint.read_manifest(saved / "step-00000016")["scalars"]["job"]["training"]["lr"] == 3e-3


def test_the_override_options_need_resume(tmp_path):
    refused(gpt, GPT + ["--steps", 2, OVERRIDE], f"{OVERRIDE} needs --resume")


@pytest.mark.parametrize("job, argv", [(gpt, GPT + ["--steps", 2]), (mlp, ["--no-progress", "--epochs", 1])])
def test_a_save_dir_no_save_could_write_is_refused_before_the_first_step(tmp_path, job, argv):
    """Not after the run, by the last save's traceback: a file where the folder should be, or above it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for save_dir in (blocker, blocker / "ckpt"):
        status, out, err = run(job, argv + ["--save-dir", save_dir])
        assert status == 2 and out == "" and "Traceback" not in err, err
        assert f"error: argument --save-dir: cannot write {save_dir}: {blocker} is not a folder\n" in err, err
    assert os.listdir(tmp_path) == ["a-file"]

MLP = ["--no-progress", "--precision", "fp64", "--hidden", "16", "--epochs", "1", "--batch-size", "512"]


def test_mlp_resume_with_another_seed_is_refused_then_honoured(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    assert run(mlp, MLP + ["--save-dir", d, "--save-every", 1])[0] == 0
    keep_until(d, 1)
    refused(mlp, MLP + ["--save-dir", d, "--resume", "--seed", 7], "--seed 0 (this command line: 7)")
    refused(mlp, MLP + ["--save-dir", d, "--resume", "--hidden", 8], "sizes = [64, 16, 16, 10] (--hidden / --layers)")
    # another optimizer is named as the cause, not the learning rate its default brings (0.1 for sgd)
    refused(mlp, MLP + ["--save-dir", d, "--resume", "--optimizer", "sgd"], "trained with --optimizer adam (this "
            "command line: sgd): its optimizer state cannot carry over; resume with --optimizer adam")
    splits = []
    monkeypatch.setattr(mlp, "load_digits", lambda seed: splits.append(seed) or load_digits(seed=seed))
    status, _, err = run(mlp, MLP + ["--save-dir", d, "--resume", "--seed", 7, OVERRIDE])
    assert status == 0 and "Traceback" not in err, err
    # the new seed orders the data; the test rows stay the checkpoint's (seed 7's split would train on some of them)
    assert splits == [0] and checkpoint.read_manifest(checkpoint.latest(d))["layout"]["split_seed"] == 0


def test_local_sgd_resumed_with_another_averaging_period_is_refused_unless_an_option_says_which(tmp_path):
    """Local SGD's --sync-every is its schedule, as --lr is; the other strategies leave it unused (not recorded)."""
    d = tmp_path / "ckpt"
    local = MLP + ["--strategy", "local_sgd", "--optimizer", "sgd", "--save-dir", d]
    assert run(mlp, local + ["--sync-every", 2, "--save-every", 2])[0] == 0
    keep_until(d, 2)
    refused(mlp, local + ["--resume", "--sync-every", 1], "trained with --sync-every 2 (this command line: 1)")
    refused(mlp, local + ["--resume", "--sync-every", 1, "--save-every", 1, USE_CHECKPOINT],   # the period it keeps
            "--save-every 1 must be a multiple of --sync-every 2")
    status, _, err = run(mlp, local + ["--resume", "--sync-every", 1, USE_CHECKPOINT])
    assert status == 0 and "Traceback" not in err, err
    assert checkpoint.read_manifest(checkpoint.latest(d))["layout"]["sync_every"] == 2
    e = tmp_path / "ddp"              # DDP's checkpoint holds no period: local SGD continues it at any
    assert run(mlp, MLP + ["--optimizer", "sgd", "--save-dir", e, "--save-every", 2])[0] == 0
    keep_until(e, 2)
    status, _, err = run(mlp, local[:-1] + [e, "--resume", "--sync-every", 1])
    assert status == 0 and "Traceback" not in err, err


def test_a_constant_schedule_warms_up_for_the_steps_asked_and_not_unasked(tmp_path):
    """--lr-schedule constant with --warmup-steps 3 rises lr/3, 2lr/3, lr, then stays; without it, lr from the
    start (30 steps, where cosine's default warm-up would be 3)."""
    lr = 3e-3
    for warmup, expected in ((["--warmup-steps", 3], [2 / 3, 1.0, 1.0]), ([], [1.0, 1.0, 1.0])):
        d = tmp_path / f"constant{len(warmup)}"
        status, _, err = run(gpt, GPT + ["--steps", 30, "--lr-schedule", "constant", "--save-dir", d, "--save-every", 1]
                             + warmup)
        assert status == 0, err
        assert [schedule_at(d, step)["_last_lr"][0] for step in (1, 2, 30)] == pytest.approx(
            [lr * f for f in expected], rel=1e-12)


def test_the_other_job_s_checkpoint_is_refused_by_its_job_not_by_its_optimizer_or_lr(saved, tmp_path):
    """The mlp job on the gpt job's checkpoint was told to resume with --optimizer adamw (which it has not), the gpt
    job on the mlp's to choose between the two --lr: the job is the cause, named before what follows from it."""
    refused(mlp, MLP + ["--save-dir", saved, "--resume"], "was saved by the gpt job, not this mlp job")
    d = tmp_path / "mlp"
    assert run(mlp, MLP + ["--save-dir", d])[0] == 0
    err = refused(gpt, GPT + ["--steps", 8, "--save-dir", d, "--resume"], "was saved by the mlp job, not this gpt job")
    assert "--lr" not in err.splitlines()[-1], err

"""The jobs' ``--save-dir / --save-every / --resume``, run as a user runs them (one process in-process,
several under mpiexec): interrupted and uninterrupted runs compared loss by loss (``--json``'s
``losses`` and ``first_step``), across layouts and rank counts, a rank killed with SIGKILL, and
checkpoints the job must refuse. Float64 throughout; across layouts the tolerance is float64
reduction-order noise (measured: at most 2.2e-16 relative on these runs, asserted at 1e-13)."""
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from minitrain import checkpoint
from minitrain.examples import gpt, mlp
from minitrain.testing import MPIRunError, mpiexec_path, run_mpi

CROSS_LAYOUT_RTOL = 1e-13


@pytest.fixture(autouse=True)
def _collect_the_jobs_garbage():
    """A job run in-process leaves reference cycles that only the collector frees; later tests read the
    global memory tracker, so free them now."""
    yield
    gc.collect()
MLP = ["--no-progress", "--precision", "fp64"]
GPT = ["--no-progress", "--precision", "fp64", "--steps", "12", "--n-embd", "32", "--block-size", "16",
       "--batch-size", "8", "--sample-chars", "1"]


def run(module, args, n, out):
    """One run of a job; returns its --json report."""
    args = [*map(str, args), "--json", str(out)]
    if n == 1:
        assert {"mlp": mlp, "gpt": gpt}[module].main(args) == 0
    else:
        run_mpi([sys.executable, "-m", f"minitrain.examples.{module}", *args], n=n, timeout=180)
    with open(out) as f:
        return json.load(f)


def keep_until(directory, step):
    """Delete the checkpoints after ``step``: as if the job had died right after saving ``step``."""
    for saved, _, path in checkpoint.list_checkpoints(directory):
        if saved > step:
            shutil.rmtree(path)


def assert_continues(report, reference, rtol=0.0):
    first, losses = report["first_step"], report["losses"]
    expected = reference["losses"][first:first + len(losses)]
    assert len(losses) == len(expected) > 0
    if rtol == 0.0:
        assert losses == expected
    else:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        assert worst <= rtol, f"relative difference {worst:.3g} > {rtol}"


@pytest.mark.slow
def test_mlp_zero3_on_4_ranks_resumes_as_ddp_on_2_then_in_one_process(tmp_path):
    d = tmp_path / "ckpt"
    reference = run("mlp", MLP + ["--epochs", "1"], 1, tmp_path / "ref.json")
    first = run("mlp", MLP + ["--epochs", "1", "--strategy", "zero3", "--save-dir", d, "--save-every", "8"], 4,
                tmp_path / "zero3.json")
    assert [s for s, _, _ in checkpoint.list_checkpoints(d)] == [8, 16, 23]       # every 8, and the last step
    manifest = checkpoint.read_manifest(checkpoint.latest(d))
    assert (manifest["layout"]["zero_stage"], manifest["world_size"], len(manifest["files"])) == (3, 4, 4)
    assert_continues(first, reference, CROSS_LAYOUT_RTOL)       # the last batch's 30 rows included (8/8/7/7)
    keep_until(d, 8)
    second = run("mlp", MLP + ["--epochs", "1", "--strategy", "ddp", "--save-dir", d, "--save-every", "8", "--resume"],
                 2, tmp_path / "ddp.json")
    assert second["first_step"] == 8
    assert_continues(second, reference, CROSS_LAYOUT_RTOL)
    keep_until(d, 16)
    third = run("mlp", MLP + ["--epochs", "1", "--save-dir", d, "--resume"], 1, tmp_path / "one.json")
    assert third["first_step"] == 16 and len(third["losses"]) == 7
    assert_continues(third, reference, CROSS_LAYOUT_RTOL)


@pytest.mark.slow
def test_gpt_dp4_resumes_as_tp2_x_pp2_then_in_one_process(tmp_path):
    d = tmp_path / "ckpt"
    reference = run("gpt", GPT, 1, tmp_path / "ref.json")
    first = run("gpt", GPT + ["--dp", "4", "--save-dir", d, "--save-every", "4"], 4, tmp_path / "dp.json")
    assert_continues(first, reference, CROSS_LAYOUT_RTOL)
    keep_until(d, 4)
    second = run("gpt", GPT + ["--tp", "2", "--pp", "2", "--microbatches", "2", "--save-dir", d, "--save-every", "4",
                               "--resume"], 4, tmp_path / "3d.json")
    assert second["first_step"] == 4 and (second["pp"], second["tp"]) == (2, 2)
    assert_continues(second, reference, CROSS_LAYOUT_RTOL)
    keep_until(d, 8)
    third = run("gpt", GPT + ["--save-dir", d, "--resume"], 1, tmp_path / "one.json")
    assert third["first_step"] == 8 and len(third["losses"]) == 4
    assert_continues(third, reference, CROSS_LAYOUT_RTOL)
    assert third["final_val_loss"] == pytest.approx(reference["final_val_loss"], rel=1e-12)


@pytest.mark.slow
def test_gpt_tensor_and_sequence_parallel_with_dropout_resumes_bit_for_bit(tmp_path):
    d = tmp_path / "ckpt"
    flags = GPT + ["--tp", "2", "--sequence-parallel", "--dropout", "0.1", "--save-dir", d]
    straight = run("gpt", flags + ["--save-every", "5"], 2, tmp_path / "a.json")
    keep_until(d, 5)
    resumed = run("gpt", flags + ["--resume"], 2, tmp_path / "b.json")
    assert resumed["first_step"] == 5
    assert_continues(resumed, straight)
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    # and holds what the uninterrupted run holds (rank 0 validated the resumed model in a copy it let go)
    assert [r["memory"] for r in resumed["ranks"]] == [r["memory"] for r in straight["ranks"]]


def _descends_from(pid, ancestor):
    while pid > 1:
        if pid == ancestor:
            return True
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return False


def rank_pid(launcher, rank):
    """The pid of MPI rank ``rank`` under the mpiexec process ``launcher`` (from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if f"PMI_RANK={rank}".encode() in env and _descends_from(int(entry), launcher):
                return int(entry)
        except OSError:
            continue
    return None


@pytest.mark.slow
def test_a_rank_killed_after_a_checkpoint_resumes_onto_the_uninterrupted_losses(tmp_path):
    d = tmp_path / "ckpt"
    flags = MLP + ["--strategy", "zero2", "--epochs", "6", "--save-dir", d, "--save-every", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "120"}
    launcher = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, "-m", "minitrain.examples.mlp", *map(str, flags),
                                 "--json", str(tmp_path / "killed.json")], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(checkpoint.list_checkpoints(d)) < 2 and time.monotonic() < deadline:   # resume picks the newest
            time.sleep(0.01)
        victim = rank_pid(launcher.pid, 1)
        assert victim is not None and len(checkpoint.list_checkpoints(d)) >= 2, "no checkpoints appeared"
        os.kill(victim, signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert not (tmp_path / "killed.json").exists()                   # the job died before its end
    newest = checkpoint.list_checkpoints(d)[-1][0]
    assert 40 <= newest < 6 * 23 and newest % 20 == 0
    resumed = run("mlp", flags + ["--resume"], 2, tmp_path / "resumed.json")
    straight = run("mlp", MLP + ["--strategy", "zero2", "--epochs", "6"], 2, tmp_path / "straight.json")
    assert resumed["first_step"] == newest
    assert_continues(resumed, straight)


@pytest.mark.slow
def test_pipedream_2bw_resumes_on_another_pipeline_layout_and_nowhere_else(tmp_path, capsys):
    d = tmp_path / "ckpt"
    pipe = MLP + ["--epochs", "1", "--strategy", "pipeline", "--schedule", "pipedream_2bw", "--microbatches", "4"]
    straight = run("mlp", pipe + ["--save-dir", d, "--save-every", "10"], 2, tmp_path / "a.json")
    keep_until(d, 10)
    assert any(k.endswith("/stash") for k in checkpoint.read_manifest(checkpoint.latest(d))["tensors"])
    resumed = run("mlp", pipe + ["--save-dir", d, "--resume"], 1, tmp_path / "b.json")     # 2 stages -> 1
    assert resumed["first_step"] == 10
    assert_continues(resumed, straight, CROSS_LAYOUT_RTOL)
    keep_until(d, 10)
    assert mlp.main(MLP + ["--epochs", "1", "--save-dir", str(d), "--resume"]) == 2
    assert "PipeDream-2BW's stashed weights W(t-1)" in capsys.readouterr().err


@pytest.mark.slow
def test_local_sgd_resumes_bit_for_bit_and_only_on_its_own_layout(tmp_path, capsys):
    d = tmp_path / "ckpt"
    flags = MLP + ["--epochs", "1", "--strategy", "local_sgd", "--sync-every", "4", "--save-dir", str(d)]
    straight = run("mlp", flags + ["--save-every", "8"], 2, tmp_path / "a.json")
    keep_until(d, 8)
    resumed = run("mlp", flags + ["--resume"], 2, tmp_path / "b.json")
    assert_continues(resumed, straight)
    # step 23, the run's last, was saved after an averaging the uninterrupted longer run does not do
    with pytest.raises(MPIRunError) as err:
        run("mlp", flags + ["--resume", "--epochs", "2"], 2, tmp_path / "c.json")
    assert "averaged at step 23, the last step of the run that saved it, off its --sync-every 4 period" in str(err.value)
    keep_until(d, 8)
    assert mlp.main(MLP + ["--epochs", "1", "--save-dir", str(d), "--resume"]) == 2
    assert "saved by local SGD on 2 ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mlp.main(flags + ["--save-every", "6"])
    assert "must be a multiple of --sync-every 4" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", [["--strategy", "ddp"], ["--strategy", "zero1"], ["--strategy", "zero3", "--offload"],
                                      ["--strategy", "pipeline", "--schedule", "gpipe", "--microbatches", "2"],
                                      ["--strategy", "zero2", "--precision", "bf16"]],
                         ids=["ddp", "zero1", "zero3+offload", "pipeline", "zero2+bf16"])
def test_every_strategy_takes_the_options_and_resumes_exactly_in_one_process(tmp_path, strategy, capsys):
    """Resumed mid-epoch, and at the epoch's short last batch (1,438 rows: 5 batches of 256, then 158), the one
    step left out of the step figures: a run with no other step has none, and says so."""
    d, last = tmp_path / "ckpt", tmp_path / "ckpt-5"
    flags = MLP + ["--epochs", "1", "--batch-size", "256", "--save-dir", d] + strategy
    straight = run("mlp", flags + ["--save-every", "1"], 1, tmp_path / "a.json")
    shutil.copytree(d, last)
    keep_until(d, 3)
    resumed = run("mlp", flags + ["--resume"], 1, tmp_path / "b.json")
    assert resumed["first_step"] == 3
    assert_continues(resumed, straight)
    keep_until(last, 5)
    flags[flags.index(d)] = last
    capsys.readouterr()
    short = run("mlp", flags + ["--resume", "--show-plan"], 1, tmp_path / "c.json")
    assert short["first_step"] == 5 and short["steady_state"]["steps_measured"] == 0
    assert_continues(short, straight)
    assert short["samples_per_second"] == 0 and short["step_time_s"] == 0
    out = capsys.readouterr().out
    assert "no step timed (the run's only step was an epoch's short last batch)" in out
    assert "0.00 ms measured" not in out and "predicted, no step measured" in out


def test_resume_from_an_empty_directory_starts_from_step_0_and_a_finished_run_has_nothing_left(tmp_path, capsys):
    d = tmp_path / "none"
    flags = GPT + ["--steps", "3", "--save-dir", d]
    report = run("gpt", flags + ["--resume"], 1, tmp_path / "a.json")
    assert report["first_step"] == 0 and len(report["losses"]) == 3
    assert f"no checkpoint in {d}: starting from step 0" in capsys.readouterr().out
    assert [s for s, _, _ in checkpoint.list_checkpoints(d)] == [3]        # the last step is always saved
    again = run("gpt", flags + ["--resume"], 1, tmp_path / "b.json")
    assert again["first_step"] == 3 and again["losses"] == []


def test_a_corrupt_checkpoint_stops_the_job_with_the_file_and_the_tensor(tmp_path, capsys):
    d = tmp_path / "ckpt"
    assert gpt.main(GPT + ["--steps", "2", "--save-dir", str(d)]) == 0
    path = checkpoint.latest(d)
    manifest = checkpoint.read_manifest(path)
    piece = manifest["tensors"]["model/h.1.mlp.c_fc.weight"]["pieces"][0]
    file = os.path.join(path, piece["file"])
    with open(file, "r+b") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
        f.seek(header + piece["data_offsets"][0] + 100)
        f.write(b"\x00\x01")
    capsys.readouterr()
    assert gpt.main(GPT + ["--steps", "4", "--save-dir", str(d), "--resume", "--override-opt-param-scheduler"]) == 2
    err = capsys.readouterr().err
    assert "rank-00000.safetensors" in err and "model/h.1.mlp.c_fc.weight" in err and "Traceback" not in err
    assert gpt.main(GPT + ["--steps", "4", "--save-dir", str(d), "--resume", "--override-opt-param-scheduler",
                           "--precision", "fp32"]) == 2
    assert "saved with precision = 'fp64', this job has 'fp32'" in capsys.readouterr().err


def test_a_changed_global_batch_is_refused(tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    assert mlp.main(MLP + ["--epochs", "1", "--batch-size", "256", "--save-dir", d]) == 0
    capsys.readouterr()
    assert mlp.main(MLP + ["--epochs", "2", "--batch-size", "128", "--save-dir", d, "--resume"]) == 2
    assert "global_batch_size = 256, this job has 128 (the data order depends on the global batch)" in \
        capsys.readouterr().err


def test_resume_needs_a_save_dir():
    result = subprocess.run([sys.executable, "-m", "minitrain.examples.mlp", "--resume"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--resume needs --save-dir DIR" in result.stderr


def test_a_job_on_too_few_ranks_for_its_mesh_still_fails_cleanly_with_a_checkpoint(tmp_path):
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--tp", "2", "--pp", "2", "--steps", "1",
                 "--save-dir", tmp_path, "--resume"], n=2, timeout=60)
    assert "ranks per replica do not divide" in str(err.value)


#: the mlp job with rank 1's write of step 2 failing as on a full disk (the writer patched; the other ranks' succeed)
FULL_DISK_ON_RANK_1 = """import runpy, sys
from minitrain.checkpoint import core
real = core.write_rank_file
def write_rank_file(path, *args, **kwargs):
    if "step-00000002" in path and path.endswith("rank-00001.safetensors"):
        raise OSError(28, "No space left on device")
    return real(path, *args, **kwargs)
core.write_rank_file = write_rank_file
sys.argv[0] = "mlp.py"
runpy.run_module("minitrain.examples.mlp", run_name="__main__")
"""


def test_a_save_that_fails_on_one_rank_mid_run_stops_every_rank_with_one_line(tmp_path):
    """A disk that fills (or turns read-only) during the run: every rank stops at that save, the one whose write
    succeeded too, with one line naming the rank, the file and the OSError, exit status 1, no traceback; the
    checkpoints before it stay, and no half-written step is left."""
    d = tmp_path / "ckpt"
    result = run_mpi([sys.executable, "-c", FULL_DISK_ON_RANK_1, *MLP, "--epochs", "1", "--save-dir", d,
                      "--save-every", "1"], n=2, timeout=120, check=False)
    errors = [line for line in result.stdout.splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and "Traceback" not in result.stdout, result.stdout
    assert len(errors) == 1 and errors[0].startswith("[0] error: saving step 2: [rank 1] writing "), result.stdout
    assert errors[0].endswith("rank-00001.safetensors: [Errno 28] No space left on device"), result.stdout
    assert os.listdir(d) == ["step-00000001"]

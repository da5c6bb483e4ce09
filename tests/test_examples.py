"""The example jobs, run as a user runs them: in-process, as a subprocess, and under mpiexec."""
import json
import subprocess
import sys

import pytest

from minitrain.examples import gpt, mlp
from minitrain.testing import MPIRunError, run_mpi


def test_mlp_reaches_95_percent_and_writes_the_json_report(tmp_path):
    out = tmp_path / "mlp.json"
    assert mlp.main(["--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["test_accuracy"] >= 0.95
    assert report["world_size"] == 1 and report["strategy"] == "ddp"
    assert report["num_params"] == 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    rank0 = report["ranks"][0]
    psi = report["num_params"]
    assert rank0["memory"]["persistent"] == {"params": 4 * psi, "grads": 4 * psi, "optimizer_state": 8 * psi}
    assert rank0["memory"]["peak"]["activations"] > 0
    assert rank0["bytes_sent"] == 0 and report["samples_per_second"] > 0


def test_an_in_process_job_counts_its_own_bytes_not_the_processs(tmp_path):
    """Bytes the process already holds (a notebook's, an earlier test's) are not the job's: the job runs on
    a ledger of its own, and the process ledger is the same before and after."""
    from minitrain import memory
    foreign = memory.tracker()
    foreign.add("params", ("params", "left by someone else"), 500_000)
    foreign.add("grads", ("grads", "left by someone else"), 300_000)
    try:
        before = memory.snapshot()
        out = tmp_path / "mlp.json"
        assert mlp.main(["--no-progress", "--epochs", "1", "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        psi, persistent = report["num_params"], report["ranks"][0]["memory"]["persistent"]
        assert persistent == {"params": 4 * psi, "grads": 4 * psi, "optimizer_state": 8 * psi}
        assert memory.snapshot() == before
    finally:
        foreign.remove(("params", "left by someone else"))
        foreign.remove(("grads", "left by someone else"))


@pytest.mark.slow
def test_the_run_line_trains_data_parallel_on_4_ranks(tmp_path):
    out, trace_path, plot = tmp_path / "mlp.json", tmp_path / "trace.json", tmp_path / "step.png"
    result = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--json", out,
                      "--trace", trace_path, "--plot", plot], n=4, timeout=120)
    report = json.loads(out.read_text())
    assert report["world_size"] == 4 and report["test_accuracy"] >= 0.95
    assert len(report["ranks"]) == 4 and "compute vs" not in result.stdout
    # every rank sends what the ring formula says (the start-up broadcast is spread over the steps)
    assert report["bytes_per_step"] == pytest.approx(report["bytes_per_step_formula"], rel=0.01)
    assert {e["pid"] for e in json.loads(trace_path.read_text())["traceEvents"]} == {0, 1, 2, 3}
    assert plot.stat().st_size > 0


@pytest.mark.slow
def test_local_sgd_averages_every_n_steps(tmp_path):
    out = tmp_path / "mlp.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--strategy", "local_sgd",
             "--sync-every", "4", "--json", out], n=2, timeout=120)
    report = json.loads(out.read_text())
    assert report["test_accuracy"] >= 0.9
    assert report["bytes_per_step"] == pytest.approx(report["bytes_per_step_formula"], rel=0.05)


@pytest.mark.parametrize("args, message", [(["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
                                           (["--optimizer", "lbfgs"], "invalid choice")])
def test_mlp_rejects_bad_options_with_a_clear_message(args, message):
    result = subprocess.run([sys.executable, "-m", "minitrain.examples.mlp", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_gpt_loss_falls_and_it_samples(tmp_path, capsys):
    out = tmp_path / "gpt.json"
    assert gpt.main(["--steps", "120", "--no-progress", "--sample-chars", "40", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["final_val_loss"] < report["initial_val_loss"] - 1.0
    assert "sample:" in capsys.readouterr().out


def test_gpt_rejects_heads_that_do_not_divide_the_width():
    result = subprocess.run([sys.executable, "-m", "minitrain.examples.gpt", "--n-embd", "30", "--n-head", "4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "divisible" in result.stderr


@pytest.mark.parametrize("flags", [["--recompute", "full"], ["--offload-activations"]])
def test_mlp_recompute_and_offload_keep_the_result_and_report_it(tmp_path, flags):
    plain, other = tmp_path / "plain.json", tmp_path / "other.json"
    common = ["--no-progress", "--layers", "6", "--epochs", "3"]
    assert mlp.main(common + ["--json", str(plain)]) == 0
    assert mlp.main(common + flags + ["--json", str(other)]) == 0
    a, b = json.loads(plain.read_text()), json.loads(other.read_text())
    assert a["final_loss"] == b["final_loss"]                       # the same training, bit for bit
    assert b["ranks"][0]["memory"]["peak"]["activations"] < a["ranks"][0]["memory"]["peak"]["activations"]
    assert (b["bytes_offloaded_per_step"] > 0) == ("--offload-activations" in flags)


def test_gpt_samples_nothing_when_asked_for_no_characters(capsys):
    assert gpt.main(["--steps", "1", "--no-progress", "--sample-chars", "0", "--n-layer", "1", "--n-embd", "16"]) == 0
    assert "sample:" not in capsys.readouterr().out
    assert gpt.main(["--steps", "1", "--no-progress", "--sample-chars", "3", "--n-layer", "1", "--n-embd", "16"]) == 0
    out = capsys.readouterr().out
    assert len(out.split("sample:\n")[1].split("\n")[0]) == len("def ") + 3   # the prompt and the characters asked


def test_gpt_recompute_modes_train_identically(tmp_path):
    reports = {}
    for mode in ("none", "selective", "full"):
        out = tmp_path / f"{mode}.json"
        assert gpt.main(["--steps", "8", "--no-progress", "--sample-chars", "1", "--recompute", mode,
                         "--json", str(out)]) == 0
        reports[mode] = json.loads(out.read_text())
    losses = {m: r["final_val_loss"] for m, r in reports.items()}
    assert len(set(losses.values())) == 1, losses
    peaks = {m: r["ranks"][0]["memory"]["peak"]["activations"] for m, r in reports.items()}
    assert peaks["full"] < peaks["selective"] < peaks["none"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, epochs, flags", [("zero1", 3, []), ("zero2", 3, ["--precision", "bf16"]),
                                                     ("zero3", 3, ["--offload"]),
                                                     ("zero3", 4, ["--recompute", "full", "--layers", "4"])])
def test_zero_strategies_train_and_report_the_formula_memory(tmp_path, strategy, epochs, flags):
    out = tmp_path / "mlp.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--strategy", strategy,
             "--epochs", str(epochs), "--lr", "3e-3", "--json", out, *flags], n=4, timeout=120)
    report = json.loads(out.read_text())
    assert report["test_accuracy"] >= 0.9
    formula = report["memory_formula"]
    for rank in report["ranks"]:
        measured = rank["memory"]["persistent"]
        if "--offload" in flags:      # zero3 + offload: model states on the host, nothing on the device
            measured = rank["memory"]["host"]
            assert rank["memory"]["persistent"]["optimizer_state"] == 0
        for c in ("params", "grads", "optimizer_state"):
            assert formula[c] <= measured[c] <= formula[c] + 64, (c, measured[c], formula[c])
    assert report["bytes_per_step"] == pytest.approx(report["bytes_per_step_formula"], rel=0.05)
    if "--precision" in flags:       # the loss scale, kept by the optimizer inside ZeRO's (bf16: none, 1)
        assert (report["skipped_steps"], report["loss_scale"]) == (0, 1.0)
    else:
        assert "loss_scale" not in report and "skipped_steps" not in report


@pytest.mark.slow
def test_a_model_too_big_for_the_device_under_ddp_fits_under_zero3(tmp_path):
    cmd = [sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--epochs", "1",
           "--device-memory", "300000"]
    with pytest.raises(MPIRunError) as err:
        run_mpi(cmd + ["--strategy", "ddp"], n=4, timeout=60)
    assert "ddp does not fit the device" in str(err.value) and "the device capacity of 300,000 bytes" in str(err.value)
    run_mpi(cmd + ["--strategy", "zero3"], n=4, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("n, epochs, flags", [
    (2, 3, ["--schedule", "1f1b", "--microbatches", "4", "--lr", "3e-3"]),
    (2, 3, ["--schedule", "interleaved_1f1b", "--microbatches", "4", "--chunks", "2", "--layers", "3", "--lr", "3e-3"]),
    (4, 3, ["--schedule", "gpipe", "--microbatches", "4", "--dp", "2", "--lr", "3e-3"]),
    (2, 3, ["--schedule", "zb_h1", "--microbatches", "4", "--lr", "3e-3"]),
    (4, 5, ["--schedule", "zbv", "--microbatches", "8", "--lr", "3e-3"])])     # 8 stages deep: 5 epochs
def test_the_pipeline_strategy_trains_and_reports_its_bubble(tmp_path, n, epochs, flags):
    out, plot = tmp_path / "pipe.json", tmp_path / "pipe.png"
    result = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--strategy", "pipeline",
                      "--epochs", str(epochs), "--json", out, "--plot", plot, *flags], n=n, timeout=120)
    report = json.loads(out.read_text())
    assert report["test_accuracy"] >= 0.9
    pipe = report["pipeline"]
    assert pipe["schedule"] == flags[1] and 0 <= pipe["measured_bubble_fraction"] < 1
    assert pipe["formula_bubble_fraction"] > 0 and plot.stat().st_size > 0
    assert sum(pipe["residual_by_cause"].values()) == pytest.approx(
        pipe["measured_bubble_fraction"] - pipe["formula_bubble_fraction"], abs=1e-9)
    # the steps after the first but each epoch's short last batch (1,438 rows in batches of 64: 30 rows)
    assert pipe["steps_left_out"] == epochs and pipe["steps_measured"] == report["steps"] - 1 - epochs
    stages = pipe["stages"]                          # the table: every virtual stage's layers and share
    assert len(stages) == pipe["num_stages"] * pipe["chunks"] and sum(s["cost_share"] for s in stages) == \
        pytest.approx(1.0)
    assert "cost share" in result.stdout
    # what moves the messages while a rank computes: MPI was asked, the thread runs where MPI said it must
    assert pipe["progress_thread"] is (pipe["messages_move_without_sender"] is False)
    assert f"pipeline progress thread {'on' if pipe['progress_thread'] else 'off'} (MPI moves" in result.stdout
    if flags[1] == "zbv":
        assert pipe["chunks"] == 2 and stages[-1]["rank"] == 0          # the V comes back to rank 0
        assert sum(pipe["stage_seconds"]["W"]) > 0


@pytest.mark.slow
def test_four_ranks_run_the_pipeline_with_the_defaults(tmp_path):
    """`mpirun -n 4 python -m minitrain.examples.mlp --strategy pipeline`: the default MLP has enough
    layers for 4 stages; the uneven cut is reported with the bubble it implies."""
    out = tmp_path / "pipe.json"
    result = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--strategy", "pipeline",
                      "--epochs", "2", "--json", out], n=4, timeout=120)
    pipe = json.loads(out.read_text())["pipeline"]
    assert pipe["num_stages"] == 4 and pipe["layers"] == 4
    assert "stages are unequal" in result.stdout and "implied bubble" in result.stdout
    assert pipe["implied_bubble_fraction"] > 3 / 7 + 0.01                # 1F1B, m = 4, equal stages: 3/7


def test_the_pipeline_strategy_rejects_bad_shapes_clearly():
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--strategy", "pipeline", "--layers", "1"],
                n=4, timeout=60)
    assert "fewer than the 4 pipeline stages" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--sequence-parallel", "--dropout", "0.1", "--recompute", "full"]],
                         ids=["tp", "tp+sp+dropout+recompute"])
def test_gpt_trains_tensor_parallel_and_counts_megatrons_bytes(tmp_path, flags):
    out = tmp_path / "gpt.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--tp", "2", "--steps", "60", "--no-progress",
             "--sample-chars", "10", "--json", out, *flags], n=2, timeout=180)
    report = json.loads(out.read_text())
    assert report["final_val_loss"] < report["initial_val_loss"] - 1.0       # the loss falls
    assert report["bytes_per_layer_forward"] == report["bytes_per_layer_forward_formula"]
    assert report["strategy"] == ("tp+sp" if flags else "tp")
    assert report["recompute"] == ("full" if flags else "none") and report["dropout"] == (0.1 if flags else 0.0)


def test_gpt_job_s_megatron_bytes_formula_is_each_rank_s_blocks_micro_batches_and_positions(tmp_path):
    """The formula beside the measured tp bytes per block forward counts what the measuring rank's hooks see:
    its stage's blocks (tp2 x pp2, 3 blocks, an MoE layer every 2nd: stage 0 holds a dense block and an MoE
    one, 1.5 all-reduces a block, not the model's 5/3), its mean micro-batch (3 rows in 2: 1.5 rows, not the
    largest's 2) and its T/cp positions (cp 2: 8 of 16)."""
    runs = {"tp2 pp2 moe": ["--tp", "2", "--pp", "2", "--microbatches", "2", "--n-layer", "3", "--moe-experts", "4",
                            "--moe-every", "2"],
            "tp2 cp2 uneven": ["--tp", "2", "--cp", "2", "--microbatches", "2", "--batch-size", "3"]}
    job = ["--no-progress", "--precision", "fp64", "--steps", "2", "--n-embd", "32", "--block-size", "16",
           "--batch-size", "4", "--sample-chars", "0"]
    calls = "; ".join(f"assert gpt.main({job + extra + ['--json', str(tmp_path / name)]!r}) == 0"
                      for name, extra in runs.items())
    run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; {calls}"], n=4, timeout=180)
    bytes_per_row = 2 * (2 - 1) / 2 * 16 * 32 * 8                       # one all-reduce of a row, whole sequence
    for name, all_reduces, rows, positions in (("tp2 pp2 moe", 1.5, 2, 1), ("tp2 cp2 uneven", 2, 1.5, 1 / 2)):
        report = json.loads((tmp_path / name).read_text())
        assert report["bytes_per_layer_forward"] == report["bytes_per_layer_forward_formula"], name
        assert report["bytes_per_layer_forward"] == all_reduces * rows * positions * bytes_per_row, name


@pytest.mark.slow
def test_gpt_3d_job_trains_as_one_process_does(tmp_path):
    """dp 2 x pp 2 x tp 2 with sequence parallelism on 8 ranks: the same training batches, the same
    losses as one process (float32: to rounding), Megatron's bytes per layer for a micro-batch."""
    steps = ["--steps", "8", "--no-progress", "--sample-chars", "10"]
    one = tmp_path / "one.json"
    assert gpt.main([*steps, "--json", str(one)]) == 0
    out = tmp_path / "3d.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--tp", "2", "--pp", "2", "--sequence-parallel",
             "--microbatches", "2", *steps, "--json", out], n=8, timeout=240)
    report, single = json.loads(out.read_text()), json.loads(one.read_text())
    assert (report["dp"], report["pp"], report["tp"], report["strategy"]) == (2, 2, 2, "dp+pp+tp+sp")
    assert report["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)
    assert report["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=1e-4)
    assert report["bytes_per_layer_forward"] == report["bytes_per_layer_forward_formula"] > 0
    assert report["bubble_formula"] == pytest.approx(1 / 3)
    params = [r["memory"]["persistent"]["params"] for r in report["ranks"]]
    assert max(params) < single["ranks"][0]["memory"]["persistent"]["params"] / 3    # a quarter, + replicas


def test_gpt_parallel_job_rejects_a_mesh_that_does_not_fit():
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--tp", "2", "--pp", "2", "--steps", "1"],
                n=2, timeout=60)
    assert "--pp 2 x --tp 2 = 4 ranks per replica do not divide this job's 2 ranks" in str(err.value)
    with pytest.raises(MPIRunError) as err:
        run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--tp", "2", "--dp", "2", "--steps", "1"],
                n=2, timeout=60)
    assert "--dp 2 x --pp 1 x --tp 2 = 4 ranks, but this job has 2" in str(err.value)


def test_gpt_tp_rejects_heads_that_do_not_split():
    with pytest.raises(SystemExit):
        gpt.main(["--tp", "3", "--n-head", "4"])


@pytest.mark.parametrize("module, args", [
    ("mlp", ["--epochs", "0"]), ("mlp", ["--comm-timeout", "-1"]), ("mlp", ["--strategy", "pipeline", "--bogus"]),
    ("mlp", ["--strategy", "pipeline", "--dp", "2", "--epochs", "1"]),     # found after MPI starts: 2 of 3 ranks
    ("gpt", ["--steps", "0"]), ("gpt", ["--n-head", "3"]),
    ("generate", ["--tp", "3", "--bogus"]), ("generate", ["--tp", "2", "--train-steps", "0"])])  # 2 of 3 ranks
def test_a_bad_option_is_reported_once_and_every_rank_exits_2(module, args):
    result = run_mpi([sys.executable, "-m", f"minitrain.examples.{module}", *args], n=3, timeout=60, check=False)
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("error:") == 1, result.stdout            # rank 0 alone, not once per rank
    assert "Traceback" not in result.stdout


def test_a_job_names_the_mpi_it_ran_on_and_its_comm_timeout(tmp_path):
    from minitrain.testing import mpi_library_name
    out = tmp_path / "mlp.json"
    result = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--epochs", "1",
                      "--comm-timeout", "7", "--json", out], n=2, timeout=120)
    assert f"MPI: {mpi_library_name()}; check_collectives on, stall threshold 7 s" in result.stdout
    report = json.loads(out.read_text())
    assert report["mpi_library"] == mpi_library_name() and report["comm_timeout"] == 7


@pytest.mark.slow
def test_the_main_job_runs_without_the_checks_on_request_with_the_same_losses(tmp_path):
    """--no-check-collectives (to measure what the checks cost, issue 29) turns them off on the job's
    communicator, says so, and changes no number."""
    runs = {}
    for name, extra in (("on", []), ("off", ["--no-check-collectives"])):
        out = tmp_path / f"{name}.json"
        result = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--epochs", "1",
                          "--json", out, *extra], n=2, timeout=120)
        runs[name] = json.loads(out.read_text())
        assert f"check_collectives {name}" in result.stdout
    assert runs["on"]["check_collectives"] is True and runs["off"]["check_collectives"] is False
    assert runs["on"]["losses"] == runs["off"]["losses"] and len(runs["on"]["losses"]) > 1

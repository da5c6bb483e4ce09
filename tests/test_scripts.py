"""Benchmarks must keep running; they are never timed here (timings belong in scripts' output)."""
import pathlib
import runpy
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parent.parent / "scripts"


def test_bench_autograd_runs_and_reports_both_models(monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.setattr(sys, "argv", ["bench_autograd.py", "--repeats", "2", "--rounds", "1"])
    runpy.run_path(str(SCRIPTS / "bench_autograd.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "large" in out and "small" in out and "x" in out


def test_bench_recompute_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_recompute.py", "--layers", "4", "--repeats", "1"])
    runpy.run_path(str(SCRIPTS / "bench_recompute.py"), run_name="__main__")
    assert "k = sqrt(n)" in capsys.readouterr().out


def test_bench_zero_runs_and_matches_the_formulas(monkeypatch, capsys, tmp_path):
    out = tmp_path / "zero.json"
    monkeypatch.setattr(sys, "argv", ["bench_zero.py", "--ranks", "2", "--steps", "4", "--configs", "zero2", "zero3+offload",
                                      "--json", str(out), "--plot", str(tmp_path / "m.png")])
    runpy.run_path(str(SCRIPTS / "bench_zero.py"), run_name="__main__")
    assert "zero3+offload" in capsys.readouterr().out and (tmp_path / "m.png").stat().st_size > 0
    import json
    results = json.loads(out.read_text())
    zero2, offload = results["zero2/p2"], results["zero3+offload/p2"]
    shard = -(-zero2["psi"] // 2) * 4                  # one rank's padded shard, fp32
    assert zero2["bytes"] == [2 * shard, 2 * shard]     # reduce-scatter + all-gather: (p-1) shards each
    assert zero2["grads"] == [shard, shard] and zero2["optimizer_state"] == [2 * shard, 2 * shard]
    assert offload["optimizer_state"] == [0, 0] and offload["grads"] == [0, 0]


def test_bench_pipeline_runs_every_schedule(monkeypatch, capsys, tmp_path):
    out = tmp_path / "pipe.json"
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py", "--ranks", "2", "--steps", "2", "--width", "32",
                                      "--microbatches", "4", "--json", str(out), "--plot", str(tmp_path / "b.png")])
    runpy.run_path(str(SCRIPTS / "bench_pipeline.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "interleaved_1f1b v=2" in printed and "zb_h1" in printed and "zbv" in printed
    import json
    results = json.loads(out.read_text())["2"]
    assert results["gpipe/m4"]["formula_bubble_fraction"] == pytest.approx(1 / 5)
    assert set(results) == {"gpipe/m4", "1f1b/m4", "interleaved_1f1b/m4", "zb_h1/m4", "zbv/m4"}
    for r in results.values():
        assert 0 <= r["measured_bubble_fraction"] < 1 and r["steps_measured"] == 1
        assert sum(r["residual_by_cause"].values()) == pytest.approx(
            r["measured_bubble_fraction"] - r["formula_bubble_fraction"], abs=1e-9)
    gpipe, one = results["gpipe/m4"]["peak_activation_bytes_per_rank"], results["1f1b/m4"]["peak_activation_bytes_per_rank"]
    assert gpipe[0] > one[0] and gpipe[1] > 3 * one[1]          # GPipe holds all 4; 1F1B 2 on stage 0, 1 on the last
    assert [results[k]["peak_in_flight_microbatches"] for k in ("gpipe/m4", "1f1b/m4", "zb_h1/m4")] == [4, 2, 2]


def test_bench_tensor_parallel_measures_megatrons_bytes(monkeypatch, capsys, tmp_path):
    out = tmp_path / "tp.json"
    monkeypatch.setattr(sys, "argv", ["bench_tensor_parallel.py", "--tp", "1", "2", "--steps", "2", "--n-embd", "32",
                                      "--block", "16", "--batch", "2", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_tensor_parallel.py"), run_name="__main__")
    assert "tp=2+sp" in capsys.readouterr().out
    import json
    results = json.loads(out.read_text())
    for name in ("tp=2", "tp=2+sp"):
        assert results[name]["layer_bytes"] == results[name]["formula"] == 2 * 2 * (1 / 2) * 2 * 16 * 32 * 4


def test_bench_checkpoint_runs_and_holds_at_most_one_piece_extra(monkeypatch, capsys, tmp_path):
    out = tmp_path / "ckpt.json"
    monkeypatch.setattr(sys, "argv", ["bench_checkpoint.py", "--ranks", "2", "--hidden", "64", "--layers", "2",
                                      "--repeats", "1", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_checkpoint.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "save + fsync" in printed and "load, resharded to DDP" in printed
    import json
    results = json.loads(out.read_text())
    psi = 2 * (64 * 64 + 64)
    assert results["psi"] == psi and results["model_bytes"] == 3 * 4 * psi       # params + 2 moments, no padding
    for extra, piece in zip(results["load_extra"], results["largest_piece"]):
        assert extra <= piece + 256 * 1024                  # one piece in memory (+ the plan's JSON)
    assert all(v > 0 for v in results["seconds"].values())


def _standin_env(**extra):
    import os
    standin = str(pathlib.Path(__file__).parent / "standin")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([standin, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", **extra}


def test_bench_gpu_runs_under_the_cupy_standin_and_counts_what_fusion_saves(tmp_path):
    import json
    import subprocess
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu.py"), "--tiny", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, env=_standin_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PyTorch CUDA anchor SKIPPED" in result.stdout and "gpt tiny" in result.stdout
    report = json.loads(out.read_text())
    for row in list(report["gpt"].values()) + list(report["mlp"].values()):
        assert row["per_step"]["sync"] == 0 and row["per_step"]["device_syncs"] == 0
        assert row["per_step"]["kernels"] < row["per_step_unfused"]["kernels"] / 2
        assert row["ratio"] is None                       # no CUDA here: no anchor, no ratio


def test_gpu_validate_runs_its_steps_and_keeps_going_after_a_failure(tmp_path):
    import json
    import subprocess
    from minitrain.testing import mpiexec_path
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_validate.sh"), str(tmp_path), "env", "nosuchstep", "tests",
                             "transport"], capture_output=True, text=True, timeout=600,
                            env=_standin_env(PYTHON=sys.executable, MPIRUN=mpiexec_path()))
    assert result.returncode == 1, result.stdout + result.stderr          # the unknown step fails the run...
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert {s: v["status"] for s, v in figures["steps"].items()} == {"env": "ok", "tests": "ok", "transport": "ok"}
    env_log = (tmp_path / "env.log").read_text()                         # ...and the others ran
    assert "rank 1: local rank 1, GPU cuda:1" in env_log and "MPI CUDA-aware: False" in env_log
    assert "no test ran: no real GPU here" in (tmp_path / "tests.log").read_text()


def test_bench_inference_measures_waste_by_the_formula_and_every_scheme(monkeypatch, capsys, tmp_path):
    out = tmp_path / "inference.json"
    monkeypatch.setattr(sys, "argv", ["bench_inference.py", "--n-layer", "1", "--n-embd", "16", "--context", "32",
                                      "--num-prompts", "4", "--max-prompt-len", "12", "--max-new-tokens", "8",
                                      "--batches", "1", "4", "--block-sizes", "1", "5", "--block-size", "4",
                                      "--repeats", "1", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_inference.py"), run_name="__main__")
    assert "paged gather" in capsys.readouterr().out
    import json
    results = json.loads(out.read_text())
    for name, w in results["waste"].items():          # the script asserts waste == formula; here: reported
        assert w["reserved"] - w["used"] == w["formula"] >= 0
    assert set(results["throughput"]["4"]) == {"none", "contiguous", "paged"}
    swap, recompute = results["preemption"]["swap"], results["preemption"]["recompute"]
    assert swap["preemptions"] > 0 and swap["blocks_swapped"] > 0 and swap["recomputed_tokens"] == 0
    assert recompute["preemptions"] > 0 and recompute["blocks_swapped"] == 0 and recompute["recomputed_tokens"] > 0

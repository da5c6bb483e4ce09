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

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

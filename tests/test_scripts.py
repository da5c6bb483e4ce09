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
                                      "--json", str(out), "--plot", str(tmp_path / "b.png")])
    runpy.run_path(str(SCRIPTS / "bench_pipeline.py"), run_name="__main__")
    assert "interleaved_1f1b v=2" in capsys.readouterr().out
    import json
    results = json.loads(out.read_text())["2"]
    assert results["gpipe/m4"]["formula"] == pytest.approx(1 / 5)
    assert all(0 <= r["bubble"] < 1 for r in results.values())


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


def test_bench_collectives_runs_and_names_the_mpi_it_ran_on(monkeypatch, capsys, tmp_path):
    out = tmp_path / "coll.json"
    monkeypatch.setattr(sys, "argv", ["bench_collectives.py", "--ranks", "2", "--max-mib", "0.004",
                                      "--min-time", "0.01", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_collectives.py"), run_name="__main__")
    text = capsys.readouterr().out
    import json
    from minitrain.testing import mpi_library_name
    results = json.loads(out.read_text())
    assert [r["bytes"] for r in results["rows"][0]] == [1024, 4096]
    assert all(r[k] > 0 for r in results["rows"][0] for k in ("ring_all_reduce", "mpi_allgather"))
    assert f"MPI: {mpi_library_name()}" in text and results["mpi_library"] == mpi_library_name()


def test_bench_ddp_runs_against_pytorch_and_names_the_mpi(monkeypatch, capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "ddp.json"
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py", "--ranks", "2", "--steps", "3", "--models", "small",
                                      "--local-sgd", "2", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_ddp.py"), run_name="__main__")
    text = capsys.readouterr().out
    import json
    from minitrain.testing import mpi_library_name
    results = json.loads(out.read_text())
    assert results["small/p2"]["minitrain"]["step"] > 0 and results["small/p2"]["torch"]["step"] > 0
    assert results["local_sgd/2"]["step"] > 0 and f"MPI: {mpi_library_name()}" in text


def test_every_script_is_run_by_some_test():
    """A script nobody runs rots: each file under scripts/ must be named by a test."""
    tests = pathlib.Path(__file__).parent
    sources = "".join(p.read_text() for p in tests.glob("test_*.py"))
    missing = [p.name for p in sorted(SCRIPTS.iterdir()) if p.is_file() and f'"{p.name}"' not in sources]
    assert not missing, f"scripts without a smoke test: {missing}"


def test_bench_checks_runs_and_each_configuration_switches_what_it_names(monkeypatch, capsys, tmp_path):
    out = tmp_path / "checks.json"
    monkeypatch.setattr(sys, "argv", ["bench_checks.py", "--ranks", "2", "--steps", "2", "--big-reps", "1",
                                      "--rounds", "1", "--mib", "0.01", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_checks.py"), run_name="__main__")
    text = capsys.readouterr().out
    import json
    from minitrain.testing import mpi_library_name
    results = json.loads(out.read_text())
    assert f"MPI: {mpi_library_name()}" in text and results["mpi_library"] == mpi_library_name()
    for workload, seconds in results["seconds"].items():
        assert set(seconds) == {"all", "-check", "-sizes", "none"} and all(s > 0 for s in seconds.values())
        did = results["did"][workload]
        assert did["all"]["header_messages"] > 0 and did["-check"]["header_messages"] == 0, did
        assert did["-sizes"]["recorded_calls"] > 0 and did["none"]["recorded_calls"] == 0, did

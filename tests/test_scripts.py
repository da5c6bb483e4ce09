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
    printed = capsys.readouterr().out
    assert "zero3+offload" in printed and (tmp_path / "m.png").stat().st_size > 0
    from minitrain.testing import mpi_library_name
    assert f"MPI: {mpi_library_name()}" in printed
    import json
    results = json.loads(out.read_text())
    zero2, offload = results["zero2/p2"], results["zero3+offload/p2"]
    shard = -(-zero2["psi"] // 2) * 4                  # one rank's padded shard, fp32
    assert zero2["bytes"] == [2 * shard, 2 * shard]     # reduce-scatter + all-gather: (p-1) shards each
    assert zero2["grads"] == [shard, shard] and zero2["optimizer_state"] == [2 * shard, 2 * shard]
    assert offload["optimizer_state"] == [0, 0] and offload["grads"] == [0, 0]
    assert zero2["hidden_fraction"] == [None, None] and all(h <= 1 for h in offload["hidden_fraction"])


def test_bench_zero_counts_the_waits_and_the_collectives_of_ddp_and_fsdp():
    hidden_spans = runpy.run_path(str(SCRIPTS / "bench_zero.py"))["hidden_spans"]
    span = lambda name, start, end: {"name": name, "start": start, "end": end}       # noqa: E731
    events = [span("ring_all_gather", 0.0, 2.0), span("all-gather unit 1", 1.5, 2.0),     # FSDP's prefetch
              span("ring_reduce_scatter", 3.0, 4.0), span("wait for reduce-scatter", 3.5, 4.0),
              span("ring_all_reduce", 5.0, 7.0), span("wait for buckets", 6.0, 7.0),       # DDP's buckets
              span("broadcast", 8.0, 9.0), span("forward", 0.0, 1.0)]                       # neither
    assert hidden_spans(events) == (2.0, 5.0)


def test_bench_pipeline_runs_every_schedule(monkeypatch, capsys, tmp_path):
    out = tmp_path / "pipe.json"
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py", "--ranks", "2", "--steps", "2", "--width", "32",
                                      "--microbatches", "4", "--json", str(out), "--plot", str(tmp_path / "b.png")])
    runpy.run_path(str(SCRIPTS / "bench_pipeline.py"), run_name="__main__")
    printed = capsys.readouterr().out
    from minitrain.testing import mpi_library_name
    assert "interleaved_1f1b v=2" in printed and "zb_h1" in printed and "zbv" in printed
    assert f"MPI: {mpi_library_name()}" in printed
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
    assert printed.count("  targets: ") == 1 + 5 and "< 1f1b" in printed and "< interleaved_1f1b" in printed
    assert all(r["message_cost_s"] >= 0 for r in results.values())


def test_bench_pipeline_runs_the_issues_job_and_prints_its_targets(monkeypatch, capsys, tmp_path):
    out = tmp_path / "job.json"
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py", "--job", "--width", "32", "--epochs", "1", "--microbatches",
                                      "4", "--schedules", "1f1b", "zb_h1", "--wait-quiet", "0.5", "--json", str(out)])
    import minitrain.testing
    waits = []
    monkeypatch.setattr(minitrain.testing, "wait_for_quiet", lambda share, timeout: waits.append((share, timeout)))
    runpy.run_path(str(SCRIPTS / "bench_pipeline.py"), run_name="__main__")
    assert waits == [(0.5, 120.0)] * 2                  # before each of the two runs
    printed = capsys.readouterr().out
    lines = [line.split() for line in printed.splitlines() if line.startswith("  targets: ") and "verdict" not in line]
    assert [line[1:3] for line in lines] == [["1f1b", "4"], ["zb_h1", "4"]]
    assert "formula" in printed and "< 1f1b" in printed
    import json
    results = json.loads(out.read_text())["2"]
    for line in lines:                  # measured - formula = the compute's causes + the runtime's
        row = results[f"{line[1]}/m{line[2]}"]
        causes = row["residual_by_cause"]
        diff, compute, runtime = (float(x) for x in line[7:10])
        assert compute == pytest.approx(causes["stage_imbalance"] + causes["compute_spread"], abs=6e-4)
        assert compute + runtime == pytest.approx(diff, abs=1.2e-3)
        assert runtime == pytest.approx(row["measured_bubble_fraction"] - row["formula_bubble_fraction"] -
                                        causes["stage_imbalance"] - causes["compute_spread"], abs=6e-4)
    for r in results.values():
        # messages only add to a simulation: stage means with and without them, and each step's own actions
        assert r["simulated_bubble_fraction_mean_costs"] >= r["simulated_bubble_fraction_free_messages"] - 1e-12
        assert r["residual_by_cause"]["message_latency"] >= -1e-12 and r["residual_by_cause"]["message_overhead"] >= -1e-12
        assert sum(r["residual_by_cause"].values()) == pytest.approx(
            r["measured_bubble_fraction"] - r["formula_bubble_fraction"], abs=1e-9)


def test_bench_tensor_parallel_measures_megatrons_bytes(monkeypatch, capsys, tmp_path):
    out = tmp_path / "tp.json"
    # tp=1 is not listed: the speed-up's anchor is measured in the same run all the same
    monkeypatch.setattr(sys, "argv", ["bench_tensor_parallel.py", "--tp", "2", "--steps", "2", "--n-embd", "32",
                                      "--block", "16", "--batch", "2", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_tensor_parallel.py"), run_name="__main__")
    printed = capsys.readouterr().out
    from minitrain.testing import mpi_library_name
    assert "tp=2+sp" in printed and f"MPI: {mpi_library_name()}" in printed
    import json
    results = json.loads(out.read_text())
    assert list(results) == ["tp=1", "tp=2", "tp=2+sp"] and "tp=1" in printed.splitlines()[2]
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
    """A script nobody runs rots: each file under scripts/ must be named by a test, or run by a
    notebook's code (the notebooks are executed by tests/test_notebooks.py)."""
    import json
    tests = pathlib.Path(__file__).parent
    sources = "".join(p.read_text() for p in tests.glob("test_*.py"))
    notebooks = "".join("".join(c["source"]) for nb in sorted((tests.parent / "notebooks").glob("*.ipynb"))
                        for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
    missing = [p.name for p in sorted(SCRIPTS.iterdir())
               if p.is_file() and f'"{p.name}"' not in sources and f"scripts/{p.name}" not in notebooks]
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
    assert results["check_share_estimate"]["collectives_per_step"] == 1       # DDP: one bucket, one all-reduce
    assert "check_collectives on the mlp step, estimated: 1 collective(s) per step" in text
    assert set(results["check_share_paired"]) == set(results["seconds"]) and "paired per round" in text


def test_bench_checkpoint_runs_and_holds_at_most_one_piece_extra(monkeypatch, capsys, tmp_path):
    out = tmp_path / "ckpt.json"
    monkeypatch.setattr(sys, "argv", ["bench_checkpoint.py", "--ranks", "2", "--hidden", "64", "--layers", "2",
                                      "--repeats", "1", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_checkpoint.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "save + fsync" in printed and "load, resharded to DDP" in printed
    from minitrain.testing import mpi_library_name
    assert f"MPI: {mpi_library_name()}" in printed
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
                            env=_standin_env(PYTHON=sys.executable, MPIRUN=mpiexec_path(), TRANSPORT_ARGS="--tiny",
                                             TRANSPORT_RANKS="2", CUPY_STANDIN_IPC="1"))
    assert result.returncode == 1, result.stdout + result.stderr          # the unknown step fails the run...
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert {s: v["status"] for s, v in figures["steps"].items()} == {"env": "ok", "tests": "ok", "transport": "ok"}
    env_log = (tmp_path / "env.log").read_text()                         # ...and the others ran
    assert "rank 1: local rank 1, GPU cuda:1" in env_log and "MPI CUDA-aware: False" in env_log
    assert "transport cuda-ipc (MPI is not CUDA-aware)" in env_log
    assert "no test ran: no real GPU here" in (tmp_path / "tests.log").read_text()
    # the transport step at 2 ranks (4: tests/test_transport.py): every transport's bytes, then the bandwidth
    for n in (2,):
        assert figures["transport"][f"transport_check_{n}"]["negotiated"] == "cuda-ipc"
        bench = figures["transport"][f"transport_{n}"]
        assert bench["world_size"] == n and bench["sizes"] == [1024, 16384]
        assert set(bench["results"]) == {"ring/cuda-ipc", "ring/cuda-ipc/host", "ring/pinned-staging", "mpi/staged"}
        assert all(row["verified"] and row["busbw_GBps"] > 0 for rows in bench["results"].values() for row in rows)
        assert bench["ipc_sync"] == {"ring/cuda-ipc": "event", "ring/cuda-ipc/host": "host"}
        assert "not CUDA-aware" in bench["unavailable"]["mpi/device"] and "no NCCL" in bench["unavailable"]["nccl"]
        assert len(bench["goals"]["ring_staged_over_mpi_staged"]["by_size"]) == 2


def test_gpu_validate_job_steps_launch_jobs_whose_options_parse(tmp_path):
    """Every job the mlp, mlp2 and gpt steps would launch (DRY_RUN: the command lines only) is accepted by
    that job's own parser, --comm-timeout included: on the H200 every one of them was refused because the
    step's shell did not get COMM_TIMEOUT and passed "--comm-timeout ''"."""
    import importlib
    import json
    import shlex
    import subprocess
    from minitrain.testing import mpiexec_path
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_validate.sh"), str(tmp_path), "mlp", "mlp2", "gpt"],
                            capture_output=True, text=True, timeout=120,
                            env=_standin_env(PYTHON=sys.executable, MPIRUN=mpiexec_path(), DRY_RUN="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert {s: v["status"] for s, v in figures["steps"].items()} == {"mlp": "ok", "mlp2": "ok", "gpt": "ok"}
    jobs = [line[4:].split(": ", 1) for line in result.stdout.splitlines() if line.startswith("=== ")]
    assert len(jobs) == 16 + 22 + 16
    for name, command in jobs:
        argv = shlex.split(command)
        module, args = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
        assert args[args.index("--comm-timeout") + 1] == "40", name
        importlib.import_module(module).parse_args(args)          # a refusal is SystemExit: fails the test


def test_gpu_validate_starts_mps_for_ranks_that_share_a_gpu_and_stops_it(tmp_path):
    """One GPU for the steps' ranks: the script starts a private MPS control daemon (here a stand-in for
    nvidia-cuda-mps-control that makes and removes the control pipe), the ranks see its pipes (so the
    transport gives no advice to start MPS), and the daemon is told to quit at the end."""
    import json
    import os
    import subprocess
    from minitrain.testing import mpiexec_path
    bin_dir, calls = tmp_path / "bin", tmp_path / "mps_calls"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text('#!/bin/sh\nif [ "$1" = -d ]; then echo start >> "%s"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"\n'
                    'else echo "$(cat)" >> "%s"; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; fi\n' % (calls, calls))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = _standin_env(PYTHON=sys.executable, MPIRUN=mpiexec_path(), CUPY_STANDIN_IPC="1", CUPY_STANDIN_DEVICES="1",
                       PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)

    def env_step(**extra):                      # the script's env step; its run's MPS state
        run = subprocess.run(["bash", str(SCRIPTS / "gpu_validate.sh"), str(out), "env"], capture_output=True,
                             text=True, timeout=300, env={**env, **extra})
        return run, run.returncode == 0 and json.loads((out / "figures.json").read_text())["mps"]
    result, mps = env_step()
    assert result.returncode == 0, result.stdout + result.stderr
    assert mps == "started for this run (1 GPU(s) for up to 4 ranks)"
    assert calls.read_text().split() == ["start", "quit"]
    env_log = (out / "env.log").read_text()
    assert "GPU cuda:0" in env_log and "transport cuda-ipc (MPI is not CUDA-aware)" in env_log and "MPS" not in env_log
    assert env_step(MPS="0")[1] == "not started (MPS=0)"
    assert "share GPU 0 without MPS" in (out / "env.log").read_text()        # ...and then the ranks say so
    result, _ = env_step(MPS="yes")
    assert result.returncode == 2 and "MPS must be auto or 0, got 'yes'" in result.stderr
    assert env_step(CUPY_STANDIN_DEVICES="4")[1] == "not needed (4 GPUs for up to 4 ranks)"


def test_bench_gpu_collectives_on_one_rank_refuses_in_one_argparse_line():
    import subprocess
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu_collectives.py"), "--tiny"], capture_output=True,
                            text=True, timeout=120, env=_standin_env(CUPY_STANDIN_IPC="1"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "error: a ring all-reduce on one rank sends nothing (busbw's 2(p-1)/p is 0): start it with mpiexec -n 2 or more")


def test_probe_gpu_sharing_refuses_without_a_real_gpu_in_one_line():
    import subprocess
    result = subprocess.run([sys.executable, str(SCRIPTS / "probe_gpu_sharing.py")], capture_output=True, text=True,
                            timeout=120, env=_standin_env())
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "probe_gpu_sharing: needs a real GPU with CuPy and the CUDA driver (libcuda): the CuPy stand-in"]


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


def test_bench_planner_reports_the_ratios_and_the_search_time(monkeypatch, capsys, tmp_path):
    """Smoke test at tiny sizes: a run of validate's and one of the issue's jobs, each printed with its
    predicted and measured median step and their ratio; the criteria counted over the runs; no time asserted."""
    out = tmp_path / "planner.json"
    monkeypatch.setattr(sys, "argv", ["bench_planner.py", "--runs", "gpt-1", "zero3-adam-512", "--steps", "3",
                                      "--epochs", "1", "--search-repeats", "1", "--moe-walk", "mixtral-8x7b",
                                      "--moe-walk-layouts", "200", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_planner.py"), run_name="__main__")
    printed = capsys.readouterr().out
    import json
    import re
    results = json.loads(out.read_text())
    assert [r["name"] for r in results["runs"]] == ["gpt-1", "zero3-adam-512"]
    assert "--steps 3 " in results["runs"][0]["options"] and "--epochs 1 " in results["runs"][1]["options"]
    for r in results["runs"]:
        t = r["step_time_s"]
        line = re.search(rf"{r['name']}: predicted ([\d.]+) ms, measured median ([\d.]+) ms \(([\d.]+)x\)", printed)
        assert line, r["name"]
        assert line.group(1, 2, 3) == (f"{t['predicted'] * 1e3:.2f}", f"{t['wall'] * 1e3:.2f}",
                                       f"{r['ratios']['plain']:.2f}")
        assert r["ratios"]["plain"] == t["predicted"] / t["wall"] and 0 <= r["others_cpu_share"] <= 1
    for what in ("plain", "anchored", "busy"):
        assert set(results["criteria"][what]) == {"median", "lowest", "highest", "within", "runs", "holds"}
        assert results["criteria"][what]["runs"] == 2
    assert "within 20%: " in printed and "of 2" in printed
    assert results["search"]["cpu_seconds_best"] > 0 and "layouts fit" in results["search"]["summary"]
    walk = results["moe_walk"]             # the planner's walk of an MoE layer against every expert walked
    assert walk["same_predictions"] and walk["layouts"] == 200 and walk["cpu_seconds"] > 0
    assert f"MoE walk (mixtral-8x7b, 1024 GPUs, {walk['layouts']} layouts)" in printed
    from minitrain.plan import validate
    assert "--steps 3 " not in validate.RUNS["gpt-1"][2]              # the shortened runs were the script's alone
    assert "zero3-adam-512" not in validate.RUNS


def test_bench_planner_runs_by_default_what_fits_the_cores_and_the_issues_jobs():
    bench = runpy.run_path(str(SCRIPTS / "bench_planner.py"))
    runs = {**bench["validate"].RUNS, **bench["JOBS"]}
    assert bench["runs_that_fit"](runs, 2) == ["ddp-2", "zero1-fp16", "zero2-bf16-offload", "zero3-recompute", "gpipe",
                                         "1f1b", "zbv", "gpt-1", "gpt-tp2", "gpt-tp2-sp-selective", "gpt-pp2-full",
                                         "gpt-pp2-zbh1", "gpt-pp2-zbv", "zero3-adam-512", "gpt-pp2-1f1b"]
    assert bench["runs_that_fit"](runs, 1) == ["gpt-1"] and len(bench["runs_that_fit"](runs, 8)) == len(runs) == 18
    assert bench["JOBS"]["zero3-adam-512"][1:] == (2, "--epochs 30 --strategy zero3 --optimizer adam --hidden 512 "
                                                      "--batch-size 256")
    assert bench["JOBS"]["gpt-pp2-1f1b"][1] == 2 and bench["JOBS"]["gpt-pp2-1f1b"][2].endswith(
        "--pp 2 --schedule 1f1b --microbatches 4")


def test_bench_planner_summarizes_the_fastest_of_the_quiet_repeats():
    quietest_of = runpy.run_path(str(SCRIPTS / "bench_planner.py"))["quietest_of"]

    def run(share, wall):
        return {"others_cpu_share": share, "step_time_s": {"wall": wall}}
    repeats = [run(0.00, 9.0), run(0.04, 5.0), run(0.30, 1.0)]
    assert quietest_of(repeats) is repeats[1] and quietest_of(repeats, margin=0.01) is repeats[0]
    assert quietest_of([run(float("nan"), 2.0), run(float("nan"), 1.0)])["step_time_s"]["wall"] == 1.0


@pytest.mark.parametrize("api", ["comm", "distributed"])
def test_bench_async_runs_and_reports_a_ratio_per_size(monkeypatch, capsys, tmp_path, api):
    out = tmp_path / "async.json"
    monkeypatch.setattr(sys, "argv", ["bench_async.py", "--ranks", "2", "--max-mib", "0.004", "--repeats", "3",
                                      "--min-time", "0.01", "--api", api, "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_async.py"), run_name="__main__")
    text = capsys.readouterr().out
    import json
    from minitrain.testing import mpi_library_name
    results = json.loads(out.read_text())["p2"]
    assert [r["bytes"] for r in results["rows"]] == [1024, 4096] and results["mpi_library"] == mpi_library_name()
    assert all(r["sync"] > 0 and r["async"] > 0 and r["ratio"] == r["async"] / r["sync"] for r in results["rows"])
    assert results["max_ratio"] == max(r["ratio"] for r in results["rows"]) and "max ratio async / sync" in text
    assert results["max_paired_ratio"] == max(r["paired_ratio"] for r in results["rows"]) > 0
    assert results["api"] == api and f"{api}'s all_reduce" in text


def test_bench_message_cost_runs_and_times_each_side_warm_and_cold(monkeypatch, capsys, tmp_path):
    out = tmp_path / "messages.json"
    monkeypatch.setattr(sys, "argv", ["bench_message_cost.py", "--repeats", "2", "--bytes", "64", "--evict-mib", "0.1",
                                      "--wait-us", "50", "--json", str(out)])
    runpy.run_path(str(SCRIPTS / "bench_message_cost.py"), run_name="__main__")
    text = capsys.readouterr().out
    import json
    results = json.loads(out.read_text())
    assert set(results) == {f"{lib} {side} {state}" for lib in ("minitrain", "mpi4py") for side in ("send", "recv")
                            for state in ("warm", "cold")} | {"latency sleeping", "latency yielding"}
    assert all(t > 0 for t in results.values())
    assert text.count("x\n") == 4 and "one message of 64 B" in text and "landing at a rank that waits" in text


def _counted_options():
    """(script, option) for every option of a script that takes a positive number."""
    import re
    found = []
    for path in sorted(SCRIPTS.glob("*.py")):
        for option in re.findall(r'add_argument\("(--[a-z-]+)", type=cli\.(?:positive_int|positive_float|largest_mib|at_least\()',
                                 path.read_text()):
            found.append((path.name, option))
    return found


@pytest.mark.parametrize("script", sorted(path.name for path in SCRIPTS.glob("*.py")))
def test_every_script_answers_help_before_any_work(script, monkeypatch, capsys):
    """The README: every command takes --help. A script whose parser comes after its first GPU or MPI call
    would run (or refuse for want of a GPU) instead of saying what it does."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    assert stopped.value.code == 0 and capsys.readouterr().out.startswith("usage:"), stopped.value.code


def test_gpu_validate_answers_help_and_refuses_an_option_for_its_out_dir(tmp_path):
    """--help prints the script's header and runs no step; any other option stops before a step runs
    (it once became OUT_DIR: `cd --help` printed its help and every step ran, failing, into no folder)."""
    import subprocess
    run = lambda *argv: subprocess.run(["bash", str(SCRIPTS / "gpu_validate.sh"), *argv], capture_output=True,  # noqa: E731
                                       text=True, timeout=60, cwd=tmp_path)
    shown = run("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("Validate minitrain on an NVIDIA machine"), shown.stderr
    assert "scripts/gpu_validate.sh OUT_DIR [STEP ...]" in shown.stdout and "#####" not in shown.stdout
    assert "set -u" not in shown.stdout
    refused = run("--out", "env")
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.strip() == (
        "gpu_validate.sh: unknown option '--out' (usage: scripts/gpu_validate.sh OUT_DIR [STEP ...]; --help)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, option", _counted_options())
def test_a_script_refuses_a_count_of_zero_in_one_argparse_line(script, option, monkeypatch, capsys):
    """A benchmark given 0 ranks, steps or MiB stops while parsing, not with a traceback after a launch."""
    monkeypatch.setattr(sys, "argv", [script, option, "0"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument {option}: must be" in err and "Traceback" not in err, err


def test_every_number_a_script_takes_is_checked_while_parsing():
    import re
    loose = [(path.name, m.group(0)) for path in sorted(SCRIPTS.glob("*.py"))
             for m in re.finditer(r'add_argument\("--[a-z-]+",[^)]*type=(int|float)\b', path.read_text())]
    assert not loose, loose                        # cli.positive_int and its kin say what was wrong, in one line


def test_every_file_a_script_writes_is_checked_while_parsing():
    import re
    loose = [(path.name, m.group(1)) for path in sorted(SCRIPTS.glob("*.py"))
             for m in re.finditer(r'add_argument\("(--json|--plot|--dir)",(?:(?!type=)[^)])*\)', path.read_text())]
    assert not loose, loose                        # cli.output_file / output_image / output_folder: before the run


def test_every_list_a_script_takes_names_each_value_once():
    """--ranks 2 2 ran p = 2 twice, the second result written over the first in --json: every list option
    (nargs "+" or "*") takes action=cli.Distinct, which refuses a value given twice while parsing."""
    import ast
    loose = [(path.name, call.args[0].value) for path in sorted(SCRIPTS.glob("*.py"))
             for call in ast.walk(ast.parse(path.read_text())) if getattr(call, "func", None) is not None
             and getattr(call.func, "attr", None) == "add_argument"
             and any(k.arg == "nargs" and getattr(k.value, "value", None) in ("+", "*") for k in call.keywords)
             and not any(k.arg == "action" and ast.unparse(k.value) == "cli.Distinct" for k in call.keywords)]
    assert not loose, loose


@pytest.mark.parametrize("script, argv, message", [
    ("bench_zero.py", ["--ranks", "2", "4", "2"], "argument --ranks: 2 given more than once (each value runs once)"),
    ("bench_pipeline.py", ["--schedules", "gpipe", "gpipe"], "argument --schedules: gpipe given more than once"),
    ("bench_message_cost.py", ["--bytes", "6"], "argument --bytes: must be a multiple of 4 (float32 elements), got 6"),
    ("bench_message_cost.py", ["--wait-us", "1e6"], "argument --wait-us: must be below 1e6"),
    ("bench_tensor_parallel.py", ["--tp", "3"], "argument --tp: 3 does not divide the 8 heads"),
    ("bench_tensor_parallel.py", ["--tp", "2", "--block", "9"], "argument --tp: 2 does not divide --block 9"),
    ("bench_zero.py", ["--configs", "zero4"], "argument --configs: invalid choice: 'zero4'"),
    ("bench_inference.py", ["--min-prompt-len", "10", "--max-prompt-len", "2"], "2 is below --min-prompt-len 10"),
    ("bench_inference.py", ["--n-head", "3"], "argument --n-embd: 128 is not a multiple of --n-head 3"),
    ("bench_inference.py", ["--context", "64"], "(--max-prompt-len 64) + --max-new-tokens 32 exceed --context 64"),
    ("bench_recompute.py", ["--json", "{tmp}/no/x.json"], "argument --json: cannot write"),
    ("bench_pipeline.py", ["--job", "--ranks", "4"], "--ranks is not supported with --job (the job runs at p = 2)"),
    ("bench_pipeline.py", ["--job", "--plot", "{tmp}/b.png"], "--plot is not supported with --job"),
    ("bench_pipeline.py", ["--epochs", "2"], "--epochs is not supported with the model here (no --job)"),
    ("bench_pipeline.py", ["--ranks", "4", "--microbatches", "6"], "interleaved_1f1b takes m divisible by p, and m = 6"),
    ("bench_ddp.py", ["--ranks", "1", "--local-sgd", "4"], "--local-sgd is not supported with --ranks 1"),
    ("bench_planner.py", ["--machine", "bogus"], "argument --machine: no machine 'bogus'"),
    ("bench_gpu.py", ["--tiny", "--steps", "5"], "--steps is not supported with --tiny"),
    ("bench_gpu.py", ["--mlp", "mlp bigg"], "argument --mlp: invalid choice: 'mlp bigg'"),
    ("bench_gpu_collectives.py", ["--tiny", "--max-mib", "1"], "--max-mib is not supported with --tiny"),
    ("bench_pipeline.py", ["--ranks", "1"], "argument --ranks: must be >= 2, got 1 (a pipeline has 2 or more stages)"),
    ("bench_pipeline.py", ["--ranks", "2", "5", "--microbatches", "10"],
     "argument --ranks: interleaved_1f1b at p = 5 cuts the model's 9 Linear layers into 10 stages, and each needs one"),
    ("bench_pipeline.py", ["--ranks", "10", "--schedules", "gpipe"], "gpipe at p = 10 cuts the model's 9 Linear layers"),
    ("bench_pipeline.py", ["--steps", "1"], "argument --steps: must be >= 2, got 1 (the first step is not measured)"),
    ("bench_tensor_parallel.py", ["--steps", "1"], "argument --steps: must be >= 2, got 1 (the first step is not timed)"),
    ("bench_zero.py", ["--ranks", "2", "1"], "argument --ranks: must be >= 2, got 1 (ZeRO shards over 2 or more ranks"),
    ("bench_zero.py", ["--steps", "3"], "argument --steps: must be >= 4, got 3 (the first 3 are warm-up, not timed)"),
    ("bench_collectives.py", ["--ranks", "1"], "argument --ranks: must be >= 2, got 1 (a collective on one rank sends"),
    ("bench_async.py", ["--ranks", "1"], "argument --ranks: must be >= 2, got 1 (one rank's all-reduce sends nothing"),
    ("bench_checks.py", ["--ranks", "1"], "argument --ranks: must be >= 2, got 1 (the checks compare a call with"),
])
def test_a_script_refuses_what_its_run_cannot_do_in_one_argparse_line(script, argv, message, monkeypatch, capsys,
                                                                        tmp_path):
    monkeypatch.setattr(sys, "argv", [script] + [a.format(tmp=tmp_path) for a in argv])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err and "Traceback" not in err, err


def test_bench_zero_refuses_a_torch_anchor_asked_for_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)             # import torch raises ImportError
    monkeypatch.setattr(sys, "argv", ["bench_zero.py", "--configs", "zero1", "torch_ddp"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(SCRIPTS / "bench_zero.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "torch_ddp run(s) PyTorch, which is not installed" in err, err


def test_bench_ddp_without_torch_stops_before_any_launch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)             # import torch raises ImportError
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py", "--ranks", "1", "--steps", "1", "--local-sgd"])
    with pytest.raises(SystemExit, match="the anchor is PyTorch"):
        runpy.run_path(str(SCRIPTS / "bench_ddp.py"), run_name="__main__")
    assert "MPI:" not in capsys.readouterr().out

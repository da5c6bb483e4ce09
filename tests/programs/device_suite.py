"""The device suite's program: run a list of jobs twice each, on the CPU and on the GPU, inside one
MPI launch (``mpiexec -n N python tests/programs/device_suite.py OUT_DIR [NAME_PART ...]``: the jobs
whose names contain a part, every job without one), then compare them
(``python tests/programs/device_suite.py --compare OUT_DIR``: one line per job, exit 1 on a mismatch).

Under the CuPy stand-in (PYTHONPATH=tests/standin) the "GPU" is NumPy with CuPy's rules; on a
machine with CuPy it is the real one. For each job and device, rank 0 records the job's JSON
report, and every rank its GPU (the job's table) and, under the stand-in, the devices its kernels
ran on and its counters (copies, synchronisations, kernels). Rank 0 writes OUT_DIR/suite.N.json.
Jobs run in this process through their ``main(argv)``, so one launch covers many configurations.
"""
import contextlib
import io
import json
import os
import sys

import numpy as np

from minitrain.exercises import all_exercises

MLP = ["--epochs", "1", "--batch-size", "256"]          # one epoch in 6 steps: every code path, few anchors
GPT = ["--steps", "3", "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--batch-size", "8",
       "--sample-chars", "1"]


def mlp(name, args, ranks, tol=1e-4):
    return {"name": name, "module": "mlp", "args": MLP + args, "ranks": ranks, "tol": tol}


def gpt(name, args, ranks, tol=1e-4):
    return {"name": name, "module": "gpt", "args": GPT + args, "ranks": ranks, "tol": tol}


# every exercise's grader runs minitrain's own solution on the device (the learner's code would run there)
EXERCISES = [e.name for e in all_exercises()]

CONFIGS = [
    mlp("ddp", [], [1, 2, 4]),
    mlp("local_sgd", ["--strategy", "local_sgd", "--sync-every", "2"], [2, 4]),
    mlp("zero1", ["--strategy", "zero1"], [2, 4]),
    mlp("zero2", ["--strategy", "zero2"], [2, 4]),
    mlp("zero3", ["--strategy", "zero3"], [1, 2, 4]),
    mlp("ddp offload", ["--offload"], [1, 2]),
    mlp("zero2 offload", ["--strategy", "zero2", "--offload"], [2, 4]),
    mlp("zero3 offload", ["--strategy", "zero3", "--offload"], [2, 4]),
    mlp("ddp fp16", ["--precision", "fp16"], [1, 2], tol=1e-2),
    mlp("zero2 fp16", ["--strategy", "zero2", "--precision", "fp16"], [4], tol=1e-2),
    mlp("ddp bf16", ["--precision", "bf16"], [1, 2], tol=1e-2),
    mlp("zero3 bf16", ["--strategy", "zero3", "--precision", "bf16"], [4], tol=1e-2),
    mlp("recompute", ["--recompute", "full", "--layers", "4"], [1, 2]),
    mlp("offload activations", ["--offload-activations"], [1, 4]),
    mlp("pipeline naive", ["--strategy", "pipeline", "--schedule", "naive", "--microbatches", "2"], [2]),
    mlp("pipeline gpipe", ["--strategy", "pipeline", "--schedule", "gpipe", "--layers", "3"], [2, 4]),
    mlp("pipeline 1f1b", ["--strategy", "pipeline", "--schedule", "1f1b", "--layers", "3"], [2, 4]),
    mlp("pipeline interleaved", ["--strategy", "pipeline", "--schedule", "interleaved_1f1b", "--chunks", "2",
                                 "--layers", "3"], [2]),
    mlp("pipeline 2bw", ["--strategy", "pipeline", "--schedule", "pipedream_2bw", "--layers", "3"], [2, 4]),
    mlp("pipeline dp x pp", ["--strategy", "pipeline", "--schedule", "1f1b", "--dp", "2"], [4]),
    gpt("gpt", [], [1]),
    gpt("gpt recompute full", ["--recompute", "full"], [1]),
    gpt("gpt recompute selective", ["--recompute", "selective"], [1]),
    gpt("gpt offload activations", ["--offload-activations"], [1]),
    gpt("gpt dropout", ["--dropout", "0.1"], [1, 2], tol=5e-2),
    gpt("gpt bf16", ["--precision", "bf16"], [1], tol=1e-2),
    gpt("gpt dp", [], [2]),
    gpt("gpt tp", ["--tp", "2"], [2]),
    gpt("gpt tp sp", ["--tp", "2", "--sequence-parallel"], [2]),
    gpt("gpt tp recompute", ["--tp", "2", "--recompute", "full"], [2]),
    gpt("gpt tp offload activations", ["--tp", "2", "--offload-activations"], [2]),
    gpt("gpt pp", ["--pp", "2", "--microbatches", "2"], [2]),
    gpt("gpt tp4", ["--tp", "4"], [4]),
    gpt("gpt pp x tp", ["--tp", "2", "--pp", "2", "--microbatches", "2"], [4]),
    gpt("gpt dp x tp sp", ["--tp", "2", "--sequence-parallel"], [4]),
    gpt("gpt pp interleaved", ["--pp", "2", "--schedule", "interleaved_1f1b", "--chunks", "2",
                               "--microbatches", "2"], [4]),
    gpt("gpt moe", ["--moe-experts", "4", "--moe-capacity-factor", "1.0"], [1]),
    gpt("gpt moe dp", ["--moe-experts", "4"], [2]),
    gpt("gpt moe tp sp", ["--moe-experts", "4", "--tp", "2", "--sequence-parallel"], [2]),
    gpt("gpt moe ep zero", ["--moe-experts", "4", "--ep", "2", "--zero", "2"], [2]),
    gpt("gpt moe ep zero1 fp16", ["--moe-experts", "4", "--ep", "2", "--zero", "1", "--precision", "fp16"], [2],
        tol=1e-2),
    gpt("gpt moe ep zero3 bf16", ["--moe-experts", "4", "--ep", "2", "--zero", "3", "--precision", "bf16"], [2],
        tol=1e-2),
    gpt("gpt moe dp x tp sp x ep", ["--moe-experts", "4", "--tp", "2", "--sequence-parallel", "--ep", "2"], [4]),
    gpt("gpt cp ring", ["--cp", "2"], [2]),
    gpt("gpt cp ring bf16", ["--cp", "2", "--precision", "bf16"], [2], tol=1e-2),
    gpt("gpt cp ulysses x tp", ["--cp", "2", "--cp-method", "ulysses", "--tp", "2"], [4]),
    gpt("gpt zbv", ["--pp", "2", "--schedule", "zbv", "--microbatches", "2"], [2]),
] + [{"name": f"exercise {name}", "module": "exercise", "args": [name], "ranks": [1]} for name in EXERCISES]



def run_job(cfg, device, path):
    from minitrain import backend
    from minitrain.examples import gpt, mlp
    from minitrain.exercises.registry import get
    backend.set_device(device)
    if cfg["module"] == "exercise":
        exercise = get(cfg["args"][0])
        if device == "cpu":          # tests/test_exercises.py grades every reference on the CPU: here its count
            with open(path, "w") as f:
                json.dump({"passed": len(exercise.checks()), "failed": []}, f)
            return 0
        results = exercise.grade(exercise.reference())
        failed = [f"{r.label}: {r.explanation}" for r in results if r.status == "fail"]
        with open(path, "w") as f:
            json.dump({"passed": len(results) - len(failed), "failed": failed}, f)
        return 0
    main = {"mlp": mlp.main, "gpt": gpt.main}[cfg["module"]]
    return main(cfg["args"] + ["--no-progress", "--json", path])


def standin_state():
    cupy = sys.modules.get("cupy")
    if cupy is None or not getattr(cupy, "__standin__", False):
        return None
    return {"devices_used": cupy._standin.devices_used(), "counters": cupy._standin.counters("process")}


def main():
    if sys.argv[1] == "--compare":
        return compare_all(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 4)
    out_dir, parts = sys.argv[1], sys.argv[2:]      # parts: run only the jobs whose names contain one of them
    configs = [c for c in CONFIGS if not parts or any(part in c["name"] for part in parts)]
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    results = []
    for cfg in configs:
        if size not in cfg["ranks"]:
            continue
        entry = {"name": cfg["name"], "ranks": size}
        for device in ("cpu", "cuda"):
            path = os.path.join(out_dir, f"{cfg['name']}.{size}.{device}.json".replace(" ", "_"))
            cupy = sys.modules.get("cupy")
            if cupy is not None and getattr(cupy, "__standin__", False):
                cupy._standin.reset()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = run_job(cfg, device, path)
            from minitrain import backend
            mine = {"gpu": backend.gpu_index() if device == "cuda" else -1, "standin": standin_state()}
            everyone = world.gather(mine, root=0)
            if rank == 0:
                report = json.load(open(path)) if os.path.exists(path) else None
                entry[device] = {"exit_code": code, "report": report, "by_rank": everyone,
                                 "output_tail": out.getvalue()[-2000:]}
            world.Barrier()
        results.append(entry)
    if rank == 0:
        with open(os.path.join(out_dir, f"suite.{size}.json"), "w") as f:
            json.dump(results, f, indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
    return 0


# ---------------------------------------------------------------- comparison with the CPU
def compare(entry, cfg):
    """Problems of the GPU run against the CPU run: losses within cfg["tol"], accuracies within 0.01."""
    cpu, gpu = entry["cpu"]["report"], entry["cuda"]["report"]
    if gpu is None:
        return ["no report from the GPU run"]
    if cfg["module"] == "exercise":
        return [] if not gpu["failed"] and gpu["passed"] == cpu["passed"] > 0 else [f"grader: {gpu}"]
    problems = []
    for key in ["final_loss"] + (["final_val_loss"] if cfg["module"] == "gpt" else []):
        if abs(gpu[key] - cpu[key]) > cfg["tol"] * abs(cpu[key]):
            problems.append(f"{key} {gpu[key]:.6g} on the GPU, {cpu[key]:.6g} on the CPU")
    if "test_accuracy" in cpu and abs(gpu["test_accuracy"] - cpu["test_accuracy"]) > 0.01:
        problems.append(f"accuracy {gpu['test_accuracy']:.4f} on the GPU, {cpu['test_accuracy']:.4f} on the CPU")
    return problems


def placement_problems(entry, n, devices):
    """Rank r must compute on GPU r % devices (its job's table says so; the stand-in also records
    the devices its kernels ran on)."""
    if entry["name"].startswith("exercise") or (n == 1 and entry["name"].startswith("gpt")):
        return []                                # no MPI job: the process's default GPU 0
    problems = []
    for r, mine in enumerate(entry["cuda"]["by_rank"]):
        if mine["gpu"] != r % devices:
            problems.append(f"rank {r} on GPU {mine['gpu']}, expected {r % devices}")
        if mine["standin"] is not None and mine["standin"]["devices_used"] != [r % devices]:
            problems.append(f"rank {r}'s kernels ran on GPUs {mine['standin']['devices_used']}")
    for r, row in enumerate((entry["cuda"]["report"] or {}).get("ranks", [])):
        if "device" in row and not row["device"].startswith(f"cuda:{r % devices}"):
            problems.append(f"rank {r}'s table says {row['device']}")
    return problems


def compare_all(out_dir, devices):
    """Print one line per job of every suite.N.json in out_dir; 1 if any job disagrees with the CPU."""
    by_name, bad = {c["name"]: c for c in CONFIGS}, 0
    for name in sorted(os.listdir(out_dir)):
        if not (name.startswith("suite.") and name.endswith(".json")):
            continue
        for entry in json.load(open(os.path.join(out_dir, name))):
            n = entry["ranks"]
            problems = compare(entry, by_name[entry["name"]]) + placement_problems(entry, n, devices)
            cpu, gpu = entry["cpu"]["report"], entry["cuda"]["report"] or {}
            detail = ""
            if "final_loss" in cpu and "final_loss" in gpu:
                detail = f"loss {gpu['final_loss']:.6f} (CPU {cpu['final_loss']:.6f})"
                if "test_accuracy" in gpu:
                    detail += f", accuracy {gpu['test_accuracy']:.4f} (CPU {cpu['test_accuracy']:.4f})"
            print(f"{'FAIL' if problems else 'ok  '} n={n} {entry['name']:<28} {detail} {'; '.join(problems)}")
            bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

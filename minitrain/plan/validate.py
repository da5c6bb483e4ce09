"""The planner against measurement: python -m minitrain.plan validate [--runs NAME ...] [--markdown].

Each run launches a job (mpiexec -n N python -m minitrain.examples.mlp|gpt ... --json) at a small
size, reads what it measured (every rank's ledger peak per category, the median and fastest step) and
puts the planner's prediction for the same options beside it: memory per rank and category (the ledger
is exact, so within 5%), step time (compared where ranks <= cores: oversubscribed ranks take turns on the
cores and the prediction only scales by ranks / cores). The jobs time each step twice: by the wall clock,
which on a shared machine also counts the other jobs that hold the cores, and by the CPU time of the
step's own thread, which they cannot inflate (it still counts waiting for a peer while polling); the
prediction is compared with the latter.
The runs cover DDP, ZeRO-1/2/3, offload, fp16, GPipe, 1F1B, interleaved, TP, TP+SP, 3D and
recomputation at 1-8 ranks. The jobs run as processes: the planner never imports them.
"""
import argparse
import json
import os
import shlex
import sys
import tempfile

from . import CATEGORIES, load_machine, predict

MLP = "--epochs 1"
GPT = "--steps 8 --sample-chars 1"
# name -> (job, ranks, options); small sizes, one launch each
RUNS = {
    "ddp-2": ("mlp", 2, f"{MLP} --hidden 256 --batch-size 128"),
    "zero1-fp16": ("mlp", 2, f"{MLP} --strategy zero1 --precision fp16 --hidden 64"),
    "zero2-bf16-offload": ("mlp", 2, f"{MLP} --strategy zero2 --precision bf16 --offload --hidden 256"),
    "zero3-recompute": ("mlp", 2, f"{MLP} --strategy zero3 --recompute full --layers 4 --hidden 256"),
    "zero3-offload-4": ("mlp", 4, f"{MLP} --strategy zero3 --offload --hidden 256 --batch-size 128"),
    "gpipe": ("mlp", 2, f"{MLP} --strategy pipeline --schedule gpipe --microbatches 4 --layers 3 --hidden 256 --batch-size 128"),
    "1f1b": ("mlp", 2, f"{MLP} --strategy pipeline --schedule 1f1b --microbatches 4 --layers 3 --hidden 256 --batch-size 128"),
    "zbv": ("mlp", 2, f"{MLP} --strategy pipeline --schedule zbv --microbatches 4 --layers 3 --hidden 256 --batch-size 128"),
    "interleaved-4": ("mlp", 4, f"{MLP} --strategy pipeline --schedule interleaved_1f1b --chunks 2 --microbatches 4 --layers 7"),
    "gpt-1": ("gpt", 1, f"{GPT}"),
    "gpt-tp2": ("gpt", 2, f"{GPT} --tp 2 --n-embd 128"),
    "gpt-tp2-sp-selective": ("gpt", 2, f"{GPT} --tp 2 --sequence-parallel --recompute selective --n-embd 128"),
    "gpt-pp2-full": ("gpt", 2, f"{GPT} --pp 2 --microbatches 4 --recompute full --n-layer 4"),
    "gpt-3d-8": ("gpt", 8, f"{GPT} --tp 2 --pp 2 --microbatches 2"),
}


def planned(kind, n, options):
    """(model, layout) of a job's options, parsed by the planner's own mirror of the job's parser
    (``python -m minitrain.plan mlp|gpt <options> --world n``, exactly what a learner types)."""
    from .__main__ import model_and_layout, parser
    return model_and_layout(parser().parse_args([kind, *shlex.split(options), "--world", str(n)]))


def run(name, machine=None, timeout=300):
    """Launch one run, return {name, world, ranks: [{measured, predicted} peak bytes per rank and category],
    step_time_s: {measured (median wall), fastest (wall), cpu (median, the step's own thread), predicted}}."""
    from ..testing import run_mpi
    kind, n, options = RUNS[name]
    machine = machine if isinstance(machine, dict) else load_machine(machine)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        printed = run_mpi([sys.executable, "-m", f"minitrain.examples.{kind}", "--no-progress", "--json", out,
                           *shlex.split(options)], n=n, timeout=timeout).stdout
        with open(out) as f:
            report = json.load(f)
    model, layout = planned(kind, n, options)
    predicted = predict(model, layout, machine)
    per_stage = layout.dp * layout.tp
    ranks = []
    for r in report["ranks"]:
        stage = predicted["memory_bytes_per_stage"][r["rank"] // per_stage]
        ranks.append({"rank": r["rank"], "measured": r["memory"]["peak"], "predicted": stage})
    return {"name": name, "job": kind, "world": n, "options": options, "cores": machine.get("cores"),
            "describe": predicted["describe"], "ranks": ranks,
            "step_time_s": {"measured": report["step_time_s"], "fastest": report["step_time_min_s"],
                            "cpu": report["step_cpu_time_s"], "predicted": predicted["step_time_s"]["total"]},
            "bubble_fraction": predicted["bubble_fraction"],
            "job_printed_the_plan": "planner (python -m minitrain.plan" in printed}


def memory_error(result):
    """The largest relative error over ranks and categories (categories the ledger saw > 1 KiB)."""
    worst = 0.0
    for r in result["ranks"]:
        for c in list(CATEGORIES) + ["total"]:
            m, p = r["measured"][c], r["predicted"][c]
            if m > 1024:
                worst = max(worst, abs(p - m) / m)
            elif p > 1024:
                worst = max(worst, 1.0)
    return worst


def table(results):
    """The README's table: one row per run."""
    rows = ["| run | ranks | layout | peak memory per rank: measured / predicted (worst error) | step wall: median "
            "(fastest) | step CPU: measured / predicted (ratio) |", "|---|---|---|---|---|---|"]
    for res in results:
        heaviest = max(res["ranks"], key=lambda r: r["measured"]["total"])
        t = res["step_time_s"]
        note = "" if res["world"] <= (res["cores"] or 1) else " oversubscribed"
        rows.append(f"| `{res['job']} {res['options']}` | {res['world']} | {res['describe']} | "
                    f"{heaviest['measured']['total']:,} / {heaviest['predicted']['total']:,} B "
                    f"({memory_error(res):.2%}) | {t['measured'] * 1e3:.2f} ({t['fastest'] * 1e3:.2f}) ms | "
                    f"{t['cpu'] * 1e3:.2f} / {t['predicted'] * 1e3:.2f} ms ({t['predicted'] / t['cpu']:.2f}x{note}) |")
    return "\n".join(rows)


def main(argv=None):
    from .. import cli
    p = argparse.ArgumentParser(prog="python -m minitrain.plan validate", description=__doc__.splitlines()[0],
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN",
                   help=f"the jobs to run and compare, any of {', '.join(RUNS)} (default: all of them)")
    p.add_argument("--machine", help="machine constants (default as for plan)")
    p.add_argument("--json", metavar="PATH", help="write every run's figures (default: none written)")
    args = p.parse_args(argv)
    machine = load_machine(args.machine)
    results = []
    for name in args.runs:
        results.append(run(name, machine))
        res = results[-1]
        t = res["step_time_s"]
        print(f"{name:>22}: memory worst error {memory_error(res):.3%}; step {t['measured'] * 1e3:.2f} ms wall (median; "
              f"fastest {t['fastest'] * 1e3:.2f}), {t['cpu'] * 1e3:.2f} ms CPU; {t['predicted'] * 1e3:.2f} ms predicted "
              f"({t['predicted'] / t['cpu']:.2f}x the CPU time)", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

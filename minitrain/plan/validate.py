"""The planner against measurement: python -m minitrain.plan validate [--runs NAME ...] [--json PATH].

Each run launches a job (mpiexec -n N python -m minitrain.examples.mlp|gpt ... --json) at a small
size, reads what it measured and puts the planner's prediction for the same options beside it: memory
per rank and category (the ledger is exact, so within 5%); the graph nodes a step records (counted by the
engine: exactly); step time. A shared machine distorts a step's wall clock by whole factors (other jobs
hold the cores), so time is compared on what they distort least: the CPU time of the step's own thread
outside its waits for peers (busy: its arithmetic, Python and its own collectives' copies and
reductions), against the planner's compute plus the busy part of its collectives. Even that slows while
other jobs share the caches and the memory bus, so each step is measured in units of the anchor the jobs
run beside it (a fixed workload, plan/anchor.py; examples/step_timer.StepTimer): the lower quartile over
the run (the median beside it), times the anchor's calibrated time as a job meets it (its median with the
job's ranks at work: time.typical), for the slowest stage, its ranks averaged. The wall clock is compared
the same way (the median step in anchors: how fast the machine ran meanwhile is taken out, not other
jobs' turns on the cores), the plain median beside it. Where ranks
outnumber cores they take turns: a thread's CPU time leaves its turns out, so busy is still compared (the
planner's compute without its ranks / cores factor), and the wall clock against the whole prediction.
The runs cover DDP, ZeRO-1/2/3, offload, fp16, GPipe, 1F1B, ZB-H1, ZB-V (the MLP's and the GPT's),
interleaved, TP, TP+SP, 3D and recomputation at 1-8 ranks. The jobs run as processes: the planner never imports them.
"""
import argparse
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace

from .. import cli
from . import CATEGORIES, MachineError, load_machine, predict
from .counts import predict_nodes
from .time import typical

MLP = "--epochs 15"
GPT = "--steps 60 --sample-chars 1"
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
    "gpt-pp2-zbh1": ("gpt", 2, f"{GPT} --pp 2 --schedule zb_h1 --microbatches 4 --n-layer 4"),
    "gpt-pp2-zbv": ("gpt", 2, f"{GPT} --pp 2 --schedule zbv --microbatches 4 --n-layer 4"),
    "gpt-3d-8": ("gpt", 8, f"{GPT} --tp 2 --pp 2 --microbatches 2"),
}


def planned(kind, n, options):
    """(model, layout) of a job's options, parsed by the planner's own mirror of the job's parser
    (``python -m minitrain.plan mlp|gpt <options> --world n``, exactly what a learner types)."""
    from .__main__ import model_and_layout, parser
    return model_and_layout(parser().parse_args([kind, *shlex.split(options), "--world", str(n)]))


def run(name, machine=None, timeout=300):
    """Launch one run, return {name, world, ranks: [{measured, predicted} peak bytes per rank and category],
    nodes: {measured, predicted}, step_time_s: {wall (median), fastest (wall), wall_anchored (the wall clock in
    anchors, times the anchor's calibrated time, ranks averaged), busy (in anchors, times the
    anchor's calibrated time: the slowest stage's, its ranks averaged), busy_fastest (the fastest step's, the
    slowest rank's), waiting (median), predicted_busy, predicted (the whole step), anchor (this run's fastest
    anchor over its calibrated time: how much the machine's other jobs slowed it)}}."""
    from ..testing import run_mpi
    kind, n, options = RUNS[name]
    machine = machine if isinstance(machine, dict) else load_machine(machine)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        printed = run_mpi([sys.executable, "-m", f"minitrain.examples.{kind}", "--no-progress", "--show-plan", "--json", out,
                           *shlex.split(options)], n=n, timeout=timeout).stdout
        with open(out) as f:
            report = json.load(f)
    model, layout = planned(kind, n, options)
    layout = replace(layout, threads=report.get("blas_threads") or 0)      # the threads the job ran with
    predicted = predict(model, layout, machine)
    time = predicted["step_time_s"]
    cores = machine.get("cores") or 1
    slowdown = (report["anchor_cpu_time_s"] / machine["anchor_cpu_time_s"]
                if report.get("anchor_cpu_time_s") and machine.get("anchor_cpu_time_s") else 1.0)
    per_stage = layout.dp * layout.tp * layout.cp                      # a stage's ranks: pp is outermost
    ranks, stages = [], {}
    for r in report["ranks"]:
        stage = predicted["memory_bytes_per_stage"][r["rank"] // per_stage]
        ranks.append({"rank": r["rank"], "measured": r["memory"]["peak"], "predicted": stage,
                      "measured_host": r["memory"].get("host"), "predicted_host": predicted["host_memory_bytes"]})
        stages.setdefault(r["rank"] // per_stage, []).append((r["step"]["step_busy_per_anchor"],
                                                              r["step"].get("step_busy_per_anchor_median", 0.0)))
    # the slowest stage, its ranks (which do the same work) averaged: the largest of two noisy equals is biased
    slowest = max(stages.values(), key=lambda v: sum(q for q, _ in v))
    unit = machine["anchor_cpu_time_s"] * typical(machine, n)         # the anchor as a quiet job's step meets it
    busy = sum(q for q, _ in slowest) / len(slowest) * unit
    busy_median = sum(m for _, m in slowest) / len(slowest) * unit
    walls = [r["step"].get("step_wall_per_anchor", 0.0) for r in report["ranks"]]    # a step ends on every rank at once
    wall_anchored = sum(walls) / len(walls) * unit
    return {"name": name, "job": kind, "world": n, "options": options, "cores": cores, "threads": layout.threads,
            "describe": predicted["describe"], "ranks": ranks,
            "nodes": {"measured": report["step_autograd_nodes"], "predicted": predict_nodes(model, layout, machine)},
            "page_faults": report["step_page_faults"],
            "step_time_s": {"wall": report["step_time_s"], "fastest": report["step_time_min_s"],
                            "wall_anchored": wall_anchored,
                            "cpu": report["step_cpu_time_min_s"], "busy_fastest": report["step_busy_cpu_time_min_s"],
                            "busy": busy, "busy_median": busy_median,
                            "waiting": report["step_waiting_cpu_time_s"], "anchor": slowdown,
                            "predicted_busy": predicted["step_busy_s"],
                            "predicted": time["total"], "comm": time["comm"], "bubble": time["bubble"]},
            "bubble_fraction": predicted["bubble_fraction"],
            "job_printed_the_plan": "planner (python -m minitrain.plan" in printed}


def memory_error(result):
    """The largest relative error over ranks and categories (categories the ledger saw > 1 KiB)."""
    worst = 0.0
    for r in result["ranks"]:
        predicted = {**r["predicted"]["category_peaks"], "total": r["predicted"]["total"]}   # each at its own peak
        for c in list(CATEGORIES) + ["total"]:
            m, p = r["measured"][c], predicted[c]
            if m > 1024:
                worst = max(worst, abs(p - m) / m)
            elif p > 1024:
                worst = max(worst, 1.0)
    return worst


def busy_ratio(result):
    """Predicted / measured busy CPU time of a step (1 = exact)."""
    t = result["step_time_s"]
    return t["predicted_busy"] / t["busy"]


def wall_ratio(result):
    """Predicted / measured wall clock of a step, the measurement in anchors (1 = exact)."""
    t = result["step_time_s"]
    return t["predicted"] / t["wall_anchored"] if t.get("wall_anchored") else 0.0


def table(results):
    """docs/measured.md's table: one row per run."""
    rows = ["| run | ranks | layout | peak memory per rank: measured / predicted (worst error) | nodes | step busy CPU: "
            "measured, lower quartile (median) / predicted (ratio; anchor) | waiting CPU | wall: median (fastest) / predicted | "
            "wall in anchors / predicted (ratio) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        heaviest = max(res["ranks"], key=lambda r: r["measured"]["total"])
        t = res["step_time_s"]
        over = res["world"] > (res["cores"] or 1)
        rows.append(f"| `{res['job']} {res['options']}` | {res['world']} | {res['describe']} | "
                    f"{heaviest['measured']['total']:,} / {heaviest['predicted']['total']:,} B "
                    f"({memory_error(res):.2%}) | {res['nodes']['measured']:.0f} / {res['nodes']['predicted']} | "
                    f"{t['busy'] * 1e3:.2f} ({t['busy_median'] * 1e3:.2f}) / {t['predicted_busy'] * 1e3:.2f} ms "
                    f"({busy_ratio(res):.2f}x; "
                    f"{t['anchor']:.2f}) | {t['waiting'] * 1e3:.2f} ms | {t['wall'] * 1e3:.2f} ({t['fastest'] * 1e3:.2f}) / "
                    f"{t['predicted'] * 1e3:.2f} ms{' (ranks take turns)' if over else ''} | "
                    f"{t['wall_anchored'] * 1e3:.2f} / {t['predicted'] * 1e3:.2f} ms ({wall_ratio(res):.2f}x) |")
    return "\n".join(rows)


def main(argv=None):
    from .. import cli
    p = argparse.ArgumentParser(prog="python -m minitrain.plan validate", description=__doc__.splitlines()[0],
                                formatter_class=cli.HelpFormatter, allow_abbrev=False)
    p.add_argument("--runs", nargs="+", action=cli.Distinct, choices=list(RUNS), default=list(RUNS), metavar="RUN",
                   help=f"the jobs to run and compare, any of {', '.join(RUNS)} (default: all of them)")
    p.add_argument("--machine", help="machine constants (default as for plan)")
    p.add_argument("--json", type=cli.output_file, metavar="PATH",
                   help="write every run's figures (default: none written)")
    args = p.parse_args(argv)
    try:
        machine = load_machine(args.machine)
    except MachineError as e:
        p.error(str(e))
    results = []
    for name in args.runs:
        results.append(run(name, machine))
        res = results[-1]
        t = res["step_time_s"]
        print(f"{name:>22}: memory worst error {memory_error(res):.3%}; nodes {res['nodes']['measured']:.0f} measured, "
              f"{res['nodes']['predicted']} predicted; step busy CPU {t['busy'] * 1e3:.2f} ms measured, "
              f"{t['predicted_busy'] * 1e3:.2f} ms predicted ({busy_ratio(res):.2f}x; anchor {t['anchor']:.2f}); "
              f"wall {t['wall'] * 1e3:.2f} ms (fastest {t['fastest'] * 1e3:.2f}; in anchors {t['wall_anchored'] * 1e3:.2f}), "
              f"{t['predicted'] * 1e3:.2f} ms predicted ({wall_ratio(res):.2f}x)",
              flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    cli.run_command(main)

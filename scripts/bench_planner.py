"""The planner against the clock: its step times beside the jobs', and how long its layout search takes.

    python scripts/bench_planner.py [--runs NAME ...] [--search-repeats 3] [--json out.json]

Step time: the runs of minitrain/plan/validate.py (python -m minitrain.plan validate prints the same table),
each launched under mpiexec and compared with the planner (machines/cpu-2core.json unless --machine): the
busy CPU time of a step in anchors and the wall clock in anchors, predicted over measured. The README's
criterion, over the runs whose ranks fit the cores: the median ratio within 20%, every run within 1.5x.
A speed figure, so it lives here: on a shared machine other jobs move it (the tests compare what is exact,
memory and graph nodes: tests/test_plan_validation.py).

Search: plan gpt <GPT-3 175B> --world 1024 --search (every dp x pp x tp factoring x ZeRO x recompute x
micro-batch size x SP), process time, best of --search-repeats (README: under 2 s).

--epochs/--steps shorten the runs (the smoke test: too few steps to time anything, the table still prints).
"""
import argparse
import contextlib
import io
import json
import os
import re
import statistics
import time

from minitrain import cli
from minitrain.plan import load_machine, validate
from minitrain.plan.__main__ import main as plan_main

GPT3 = "--n-layer 96 --n-embd 12288 --n-head 96 --block-size 2048 --vocab-size 51200"
SEARCH = f"gpt {GPT3} --batch-size 1536 --world 1024 --precision bf16 --machine a100-80gb --search"


def shortened(runs, epochs, steps):
    """``runs`` with mlp's --epochs and gpt's --steps replaced (None: as they are)."""
    def edit(options):
        if epochs is not None:
            options = re.sub(r"--epochs \d+", f"--epochs {epochs}", options)
        if steps is not None:
            options = re.sub(r"--steps \d+", f"--steps {steps}", options)
        return options
    return {name: (job, n, edit(options)) for name, (job, n, options) in runs.items()}


def criterion(ratios):
    """The README's criterion over {run: predicted / measured}: (median, lowest, highest, holds)."""
    if not ratios:
        return None
    values = list(ratios.values())
    median = statistics.median(values)
    return {"median": median, "lowest": min(values), "highest": max(values),
            "holds": 0.8 <= median <= 1.2 and all(2 / 3 <= x <= 1.5 for x in values)}


def search_seconds(repeats):
    """Process time of the GPT-3 layout search, best of ``repeats``; and the line that counts the layouts."""
    best, first_line = float("inf"), ""
    for _ in range(repeats):
        buf = io.StringIO()
        start = time.process_time()
        with contextlib.redirect_stdout(buf):
            plan_main(SEARCH.split())
        best = min(best, time.process_time() - start)
        first_line = buf.getvalue().splitlines()[0]
    return best, first_line


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--runs", nargs="*", choices=list(validate.RUNS), default=list(validate.RUNS), metavar="RUN",
                    help=f"validate's runs to launch, any of {', '.join(validate.RUNS)} (default: all)")
    ap.add_argument("--machine", default="cpu-2core", help="machine constants")
    ap.add_argument("--epochs", type=int, help="mlp runs: this many epochs (default: validate's)")
    ap.add_argument("--steps", type=int, help="gpt runs: this many steps (default: validate's)")
    ap.add_argument("--search-repeats", type=int, default=3, help="timed searches, the best kept (0: none)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (default: none written)")
    args = ap.parse_args()
    machine, cores = load_machine(args.machine), os.cpu_count() or 1
    results, runs = [], validate.RUNS
    validate.RUNS = shortened(runs, args.epochs, args.steps)          # validate.run reads its options there
    try:
        for name in args.runs:
            results.append(validate.run(name, machine))
            res = results[-1]
            print(f"{name:>22}: busy {validate.busy_ratio(res):.2f}x, wall in anchors {validate.wall_ratio(res):.2f}x "
                  f"(predicted / measured; anchor {res['step_time_s']['anchor']:.2f})", flush=True)
    finally:
        validate.RUNS = runs
    if results:
        print(validate.table(results))
    fit = [r for r in results if r["world"] <= cores]
    verdicts = {"busy": criterion({r["name"]: validate.busy_ratio(r) for r in fit}),
                "wall": criterion({r["name"]: validate.wall_ratio(r) for r in fit})}
    for what, v in verdicts.items():
        if v:
            print(f"{what}, the {len(fit)} run(s) whose ranks fit the {cores} cores: median {v['median']:.2f}x "
                  f"({v['lowest']:.2f}-{v['highest']:.2f}x); median within 20% and every run within 1.5x: "
                  f"{'yes' if v['holds'] else 'NO'}")
    search = None
    if args.search_repeats:
        seconds, line = search_seconds(args.search_repeats)
        search = {"cpu_seconds_best": seconds, "repeats": args.search_repeats, "summary": line}
        print(f"search (GPT-3 175B, 1024 GPUs): {seconds:.2f} CPU s, best of {args.search_repeats} ({line})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "criteria": verdicts, "search": search, "cores": cores}, f, indent=1)


if __name__ == "__main__":
    main()

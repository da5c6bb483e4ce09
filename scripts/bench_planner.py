"""The planner against the clock: its step times beside the jobs', and how long its layout search takes.

    python scripts/bench_planner.py [--calibrate | --machine PATH] [--runs NAME ...] [--repeat 2]
                                    [--wait-quiet 0.1] [--search-repeats 3] [--json out.json]

Step time: the runs of minitrain/plan/validate.py (python -m minitrain.plan validate prints the same table)
whose ranks fit the cores, and the issue's two jobs (JOBS: ZeRO-3 with Adam on a 512-wide MLP, GPT on a
2-stage 1F1B pipeline), each launched under mpiexec and compared with the planner: the predicted step over
the measured median step (the plain wall clock, what a user reads), and over the median step in anchors
(validate.py: how fast the machine ran meanwhile taken out), and the busy CPU of a step. The criterion of
issue 29: every run's predicted / measured median within 20%.
--calibrate first runs `python -m minitrain.plan calibrate` once, as a user does, and predicts from that
(default: --machine, the committed cpu-2core). Beside each run, the share of the cores other processes
used meanwhile (/proc/stat's busy time less the run's own CPU): on a shared machine they take turns on
the cores with the ranks, which only the plain median counts. --repeat runs each R times (every ratio is
printed; the summary takes the fastest of the repeats whose others' share is within 5% of the least);
--wait-quiet S first waits (at most --quiet-timeout s) until other processes use less than S of the cores.
A speed figure, so it lives here (the tests compare what is exact, memory and graph nodes:
tests/test_plan_validation.py).

Search: plan gpt <GPT-3 175B> --world 1024 --search (every dp x pp x tp factoring x ZeRO x recompute x
micro-batch size x SP x cp, then ZB-H1 and ZB-V), process time, best of --search-repeats. --moe-walk: the
predictions of an MoE model's layouts (DeepSeek-V3's 256 experts by default), the planner's walk of an MoE
layer's first and last two experts against every expert walked, in the same run, and whether they agree.

--epochs/--steps shorten the runs (the smoke test: too few steps to time anything, the table still prints).
"""
import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from minitrain import cli
from minitrain.plan import load_machine, validate
from minitrain.plan.calibrate import MachineError
from minitrain.plan.__main__ import main as plan_main
from minitrain.testing import wait_for_quiet, with_others_share

GPT3 = "--n-layer 96 --n-embd 12288 --n-head 96 --block-size 2048 --vocab-size 51200"
SEARCH = f"gpt {GPT3} --batch-size 1536 --world 1024 --precision bf16 --machine a100-80gb --search"
# issue 29's two jobs, beside validate's runs (the mlp job at its default 30 epochs, GPT at 60 steps)
JOBS = {"zero3-adam-512": ("mlp", 2, "--epochs 30 --strategy zero3 --optimizer adam --hidden 512 --batch-size 256"),
        "gpt-pp2-1f1b": ("gpt", 2, f"{validate.GPT} --pp 2 --schedule 1f1b --microbatches 4")}
WITHIN = 0.2


def shortened(runs, epochs, steps):
    """``runs`` with mlp's --epochs and gpt's --steps replaced (None: as they are)."""
    def edit(options):
        if epochs is not None:
            options = re.sub(r"--epochs \d+", f"--epochs {epochs}", options)
        if steps is not None:
            options = re.sub(r"--steps \d+", f"--steps {steps}", options)
        return options
    return {name: (job, n, edit(options)) for name, (job, n, options) in runs.items()}


def runs_that_fit(runs, cores):
    """The runs whose ranks fit ``cores`` (the default: the criterion is theirs), in order."""
    return [name for name, (_, n, _) in runs.items() if n <= cores]


def criterion(ratios):
    """Over {run: predicted / measured}: (median, lowest, highest, within: how many within 20%, holds:
    every run within 20%)."""
    if not ratios:
        return None
    values = list(ratios.values())
    within = sum(1 for x in values if abs(x - 1) <= WITHIN)
    return {"median": statistics.median(values), "lowest": min(values), "highest": max(values),
            "within": within, "runs": len(values), "holds": within == len(values)}


def calibrated(path):
    """Run ``python -m minitrain.plan calibrate --out path`` once (as a user runs it); its constants."""
    subprocess.run([sys.executable, "-m", "minitrain.plan", "calibrate", "--out", path], check=True,
                   stdout=subprocess.DEVNULL)
    return load_machine(path)


def ratios(res):
    """{plain, anchored, busy}: predicted over measured median step, over the median in anchors, busy CPU."""
    t = res["step_time_s"]
    return {"plain": t["predicted"] / t["wall"], "anchored": validate.wall_ratio(res), "busy": validate.busy_ratio(res)}


def quietest_of(repeats, margin=0.05):
    """Of one run's repeats, the fastest of those during which other processes used at most ``margin`` of the
    cores more than the least (another process only slows a run: a share measured over the whole run misses
    a burst; NaN shares: the fastest)."""
    least = min((r["others_cpu_share"] for r in repeats if r["others_cpu_share"] == r["others_cpu_share"]),
                default=float("nan"))
    calm = [r for r in repeats if not r["others_cpu_share"] > least + margin]
    return min(calm, key=lambda r: r["step_time_s"]["wall"])


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


def moe_walk_seconds(name, first=None):
    """Process time of predicting the named MoE model's layouts on 1,024 GPUs (ZeRO-1, no recomputation, cp 1,
    2, 4), an MoE layer's backward walked at its first expert and its last two (the planner's) and at every
    expert (moe_backward_moments' every_expert), one after the other in this run after a warm-up (``first``: the
    first so many layouts only); the layouts; whether every prediction is the same."""
    from minitrain.plan import activations, experts, gpt_from_args, layouts, predict
    from minitrain.plan.__main__ import parser
    from minitrain.plan.configs import NAMED
    model, base = gpt_from_args(parser(defaults=NAMED[name]).parse_args(["gpt", "--model", name]), 1024,
                                NAMED[name]["vocab_size"])
    candidates = layouts(model, 1024, base.batch_size, precision="bf16", zeros=(1,), recomputes=("none",),
                         cps={1, 2, 4})[:first]
    machine, walk = load_machine(NAMED[name]["machine"]), experts.moe_backward_moments
    seconds, predictions = [], []
    try:
        for every in (False, False, True):        # the first a warm-up (the layers' costs memoized), untimed
            experts.moe_backward_moments = lambda *a, every=every: walk(*a, every_expert=every)
            activations._gpt_pieces.cache_clear()
            start = time.process_time()
            predictions.append([predict(model, lay, machine, per_stage=False, time_if_unfit=False) for lay in candidates])
            seconds.append(time.process_time() - start)
    finally:
        experts.moe_backward_moments = walk
        activations._gpt_pieces.cache_clear()
    return {"model": name, "layouts": len(candidates), "cpu_seconds": seconds[1], "cpu_seconds_every_expert": seconds[2],
            "same_predictions": predictions[1] == predictions[2]}


def main():
    cores = os.cpu_count() or 1
    every = {**validate.RUNS, **JOBS}
    fit = runs_that_fit(every, cores)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--runs", nargs="*", action=cli.Distinct, choices=list(every), default=fit, metavar="RUN",
                    help=f"runs to launch, any of {', '.join(every)} "
                         f"(default: those whose ranks fit the {cores} cores)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--machine", default="cpu-2core", help="machine constants")
    how.add_argument("--calibrate", action="store_true",
                     help="calibrate this machine once first and predict from that (default: --machine)")
    ap.add_argument("--repeat", type=cli.positive_int, default=1, help="runs of each (default: 1)")
    ap.add_argument("--wait-quiet", type=cli.nonneg_float, default=0.0, metavar="SHARE",
                    help="before each run, wait until other processes use less than SHARE of the cores "
                         "(default: 0, no wait)")
    ap.add_argument("--quiet-timeout", type=cli.positive_float, default=60.0, help="... but no longer than this, in seconds")
    ap.add_argument("--epochs", type=cli.positive_int, help="mlp runs: this many epochs (default: the runs')")
    ap.add_argument("--steps", type=cli.positive_int, help="gpt runs: this many steps (default: the runs')")
    ap.add_argument("--search-repeats", type=cli.nonneg_int, default=3, help="timed searches, the best kept (0: none)")
    ap.add_argument("--moe-walk", default="deepseek-v3", choices=["deepseek-v3", "mixtral-8x7b", "none"],
                    help="time the planner on this MoE model's layouts, against walking every expert (none: skip)")
    ap.add_argument("--moe-walk-layouts", type=cli.positive_int, metavar="N",
                    help="the first N of those layouts only (the smoke test's; default: every one)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the figures as JSON (default: none written)")
    args = ap.parse_args()
    if args.calibrate:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            (machine, others) = with_others_share(lambda: calibrated(os.path.join(tmp, "machine.json")))
            print(f"calibrated this machine once ({time.perf_counter() - start:.0f} s; other processes "
                  f"{others:.0%} of the cores meanwhile)", flush=True)
            print("  its median step over the best case: alone {typical_alone:.3f}, in a job {typical_job:.3f}, a "
                  "pipeline stage after a wait {typical_job_waited:.3f}; a pipeline action {a:.1f} us + {b:.2g} s/byte; "
                  "a stage-to-stage message {c:.1f} us".format(
                      a=machine.get("pipeline_action_s", 0) * 1e6, b=machine.get("pipeline_action_byte_s", 0),
                      c=machine.get("pipeline_message_s", 0) * 1e6,
                      **{k: machine.get(k, 1.0) for k in ("typical_alone", "typical_job", "typical_job_waited")}),
                  flush=True)
    else:
        try:
            machine = load_machine(args.machine)
        except MachineError as e:
            ap.error(f"argument --machine: {e}")
    results, runs = [], validate.RUNS
    validate.RUNS = shortened(every, args.epochs, args.steps)          # validate.run reads its options there
    try:
        for name in args.runs:
            for _ in range(args.repeat):
                if args.wait_quiet:
                    wait_for_quiet(args.wait_quiet, args.quiet_timeout)
                res, others = with_others_share(lambda: validate.run(name, machine))
                res.update(others_cpu_share=others, ratios=ratios(res))
                results.append(res)
                t, r = res["step_time_s"], res["ratios"]
                print(f"{name:>22}: predicted {t['predicted'] * 1e3:.2f} ms, measured median {t['wall'] * 1e3:.2f} ms "
                      f"({r['plain']:.2f}x), in anchors {t['wall_anchored'] * 1e3:.2f} ms ({r['anchored']:.2f}x); "
                      f"busy {r['busy']:.2f}x; others {others:.0%} of the cores", flush=True)
    finally:
        validate.RUNS = runs
    if results:
        print(validate.table(results))
    quietest = {}
    for name in dict.fromkeys(r["name"] for r in results):
        quietest[name] = quietest_of([r for r in results if r["name"] == name])
    fitting = [r for r in quietest.values() if r["world"] <= cores]
    verdicts = {what: criterion({r["name"]: r["ratios"][what] for r in fitting})
                for what in ("plain", "anchored", "busy")}
    words = {"plain": "wall, median step", "anchored": "wall in anchors", "busy": "busy CPU"}
    for what, v in verdicts.items():
        if v:
            print(f"{words[what]}, the quietest repeat of the {v['runs']} run(s) whose ranks fit the {cores} cores: "
                  f"predicted / measured {v['lowest']:.2f}-{v['highest']:.2f}x (median {v['median']:.2f}x); "
                  f"within {WITHIN:.0%}: {v['within']} of {v['runs']}")
    search = None
    if args.search_repeats:
        seconds, line = search_seconds(args.search_repeats)
        search = {"cpu_seconds_best": seconds, "repeats": args.search_repeats, "summary": line}
        print(f"search (GPT-3 175B, 1024 GPUs): {seconds:.2f} CPU s, best of {args.search_repeats} ({line})")
    moe_walk = None if args.moe_walk == "none" else moe_walk_seconds(args.moe_walk, args.moe_walk_layouts)
    if moe_walk:
        print(f"MoE walk ({moe_walk['model']}, 1024 GPUs, {moe_walk['layouts']} layouts): {moe_walk['cpu_seconds']:.2f} "
              f"CPU s; every expert walked {moe_walk['cpu_seconds_every_expert']:.2f} CPU s "
              f"({moe_walk['cpu_seconds_every_expert'] / moe_walk['cpu_seconds']:.1f}x); every prediction the same: "
              f"{'yes' if moe_walk['same_predictions'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "criteria": verdicts, "search": search, "moe_walk": moe_walk, "cores": cores,
                       "machine": machine.get("measured", machine.get("name"))}, f, indent=1)


if __name__ == "__main__":
    main()

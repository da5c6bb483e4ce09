"""Pipeline bubbles, measured against the formula, for every schedule and number of micro-batches.

    python scripts/bench_pipeline.py [--ranks 2 4] [--steps 6] [--repeat 1] [--wait-quiet 0.1] [--width 1024]
        [--microbatches 4 8 16] [--schedules gpipe 1f1b interleaved_1f1b zb_h1 zbv] [--plot bubbles.png]
        [--json out.json] [--job [--epochs 3]]

--job runs the issue's job instead, p = 2: `mpiexec -n 2 python -m minitrain.examples.mlp --strategy
pipeline --hidden W --layers 5 (zbv: 9) --batch-size 256 --epochs 3 --schedule S --microbatches M
[--chunks 2] --json ...`, --repeat times each, interleaved, and reports the run of median bubble.
Both modes end with the targets: measured within 0.03 of the simulation (each step's F, B, W as
measured, action by action, and the measured costs of a message: latency, the sender's time
posting it, the receiver's time taking it, as LogP prices a message), within 0.05 of the formula for GPipe and 1F1B (every m)
and interleaved (m = 8), ZB-H1 below 1F1B and ZB-V below interleaved at each m. Each measured -
formula is split "= compute + runtime": the stages' own compute (stage_imbalance + compute_spread of
residual_by_cause) and the rest (messages, Python between actions, waits beyond the schedule).

Model: a thin stem Linear(64, W) + ReLU, then 8 x (Linear(W, W) + ReLU), W = 1024 by default, global
batch 512, float32, one BLAS thread per rank. The stem costs 1/16 of a block, and because it has
weights, the first block computes its input gradient like every other: each (virtual) stage at
p = 2 and 4, v = 1 and 2, does the same F, the same B and the same W (to 1.6%), as the formula
assumes, and the counted-cost split (partition.py) cuts it so. (Without the stem, the first stage's
B would lack one block's input gradient: 7/8 of the others' at p = 2, a bubble the formula does
not count.) The measured bubble, the simulation, the formula ((p-1)/(v·m+p-1) for GPipe, 1F1B and
interleaved; the simulator's at the measured mean F, B, W for zb_h1 and zbv) and residual_by_cause are
minitrain/parallel/pipeline/measure.py's. The anchor is the same model
trained in one process on the whole batch: "speed-up" is its step time / the pipeline's. At p = 4
the 2 cores of this machine are oversubscribed: ranks wait for a core as well as for their inputs.
On a shared machine other jobs stretch some actions and not others, which the formula cannot know:
--repeat R runs every configuration R times and reports the quietest run (the one during which
other processes used the least CPU: the machine's busy time from /proc/stat minus the ranks' own
CPU time, as a share of all cores) beside the range of the R measured bubbles; --wait-quiet S
first waits (up to --quiet-timeout seconds) until other processes use less than S of the cores.
"""
import argparse
import json
import os
import time

import numpy as np

from minitrain import cli

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"]
CHUNKS = {"interleaved_1f1b": 2}
LAYERS, BATCH, STEM = 8, 512, 64


def build(width):
    from minitrain import nn
    layers = [nn.Linear(STEM, width), nn.ReLU()]
    for _ in range(LAYERS):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def data(width, steps):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, STEM)).astype(np.float32), rng.integers(0, width, BATCH))
            for _ in range(steps)]


def others_share(comm, work):
    """The share of the machine's cores that other processes used while work() ran."""
    from minitrain.comm import ring_all_gather
    from minitrain.testing import busy_seconds
    comm.barrier()
    busy, own, start = busy_seconds(), time.process_time(), time.perf_counter()
    work()
    comm.barrier()
    wall, mine = time.perf_counter() - start, time.process_time() - own
    ours = float(ring_all_gather(comm, np.array([mine]), total=comm.size).sum())
    if busy is None:
        return float("nan")
    return max(0.0, (busy_seconds() - busy - ours) / (wall * os.cpu_count()))


def wait_for_quiet(comm, share, timeout):
    """Rank 0 samples the machine over 2 s windows until other processes use less than share of
    its cores (or timeout seconds pass); the other ranks wait for its word (asleep)."""
    from minitrain.comm import broadcast
    from minitrain.testing import wait_for_quiet as wait_on_this_rank
    if comm.rank == 0:
        wait_on_this_rank(share, timeout)
    broadcast(comm, np.zeros(1), root=0)


def worker(args):
    import minitrain as mt
    from minitrain import memory, nn, optim, trace
    from minitrain.comm import init, ring_all_gather
    from minitrain.parallel.pipeline import PipelineParallel, simulate
    comm = init()
    p, r = comm.size, comm.rank
    batches = data(args.width, args.steps)
    results = {}
    if r == 0:                                   # the anchor: one process, the whole batch
        mt.manual_seed(0)
        model = build(args.width)
        opt = optim.SGD(model.parameters(), lr=1e-3)
        times = []
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(mt.Tensor(x)), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        results["single"] = float(np.median(times[1:]))
    comm.barrier()
    for name in args.schedules:
        for m in args.microbatches:
            if name == "interleaved_1f1b" and m % p:
                continue
            runs = []
            for _ in range(args.repeat):
                mt.manual_seed(0)
                pipe = PipelineParallel(build(args.width), comm, name, m, chunks=CHUNKS.get(name))
                opt = optim.SGD(pipe.parameters(), lr=1e-3)
                trace.enable(rank=r)
                comm.barrier()
                memory.reset_peak()

                def steps():
                    for x, y in batches:
                        trace.tracer().events.clear()
                        opt.zero_grad()
                        pipe.train_step(x, y, nn.functional.cross_entropy)
                        opt.step()
                if args.wait_quiet:
                    wait_for_quiet(comm, args.wait_quiet, args.quiet_timeout)
                others = others_share(comm, steps)
                runs.append({**pipe.measured_bubble(), "others_cpu_share": others})
                trace.disable()
            peak = ring_all_gather(comm, np.array([float(memory.peak()["activations"])]), total=p)
            in_flight = simulate(pipe.schedule)["peak_activations"]        # chunks of 1/v of a stage
            quiet = min(runs, key=lambda run: (run["others_cpu_share"], run["step_time_s"]))
            results[f"{name}/m{m}"] = {"m": m, "chunks": pipe.v, "peak_activation_bytes_per_rank": peak.tolist(),
                                       "peak_in_flight_microbatches": max(in_flight) / pipe.v, **quiet,
                                       "repeats": [{k: run[k] for k in ("measured_bubble_fraction", "step_time_s",
                                                                        "formula_bubble_fraction", "others_cpu_share")}
                                                   for run in runs]}
    if r == 0:
        with open(args.worker_out, "w") as f:
            json.dump(results, f)


def launch(p, args):
    from minitrain.testing import run_worker
    waits = len(args.schedules) * len(args.microbatches) * args.repeat * args.quiet_timeout if args.wait_quiet else 0
    return run_worker(__file__, p, timeout=1800 + waits,
                      args=["--steps", args.steps, "--repeat", args.repeat, "--width", args.width, "--wait-quiet",
                            args.wait_quiet, "--quiet-timeout", args.quiet_timeout, "--microbatches",
                            *args.microbatches, "--schedules", *args.schedules])


def run_job(args):
    """The issue's job per schedule and m, --repeat times (round-robin): its JSON's "pipeline"."""
    import sys
    import tempfile
    from minitrain.testing import run_mpi, wait_for_quiet
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _, name, m in ((r, n, m) for r in range(args.repeat) for n in args.schedules for m in args.microbatches):
            if name == "interleaved_1f1b" and m % 2:
                continue
            if args.wait_quiet:
                wait_for_quiet(args.wait_quiet, args.quiet_timeout)
            out = os.path.join(tmp, "job.json")
            run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--strategy", "pipeline", "--hidden", args.width,
                     "--layers", 9 if name == "zbv" else 5, "--batch-size", 256, "--epochs", args.epochs, "--schedule",
                     name, "--microbatches", m, *(["--chunks", 2] if name in CHUNKS else []), "--no-progress",
                     "--json", out], n=2, timeout=1800)
            with open(out) as f:
                runs.setdefault(f"{name}/m{m}", []).append({"m": m, **json.load(f)["pipeline"]})
    results = {}
    for key, rows in runs.items():
        rows.sort(key=lambda row: row["measured_bubble_fraction"])
        results[key] = {**rows[len(rows) // 2], "repeats": [row["measured_bubble_fraction"] for row in rows]}
    return results


# measured - formula that the stages' own compute makes (residual_by_cause): unequal stages, and each
# action's time apart from its stage's mean (caches, the other core's memory traffic); the rest is the runtime's
COMPUTE_CAUSES = ("stage_imbalance", "compute_spread")


def formula_gap(row):
    """(compute, runtime): measured - formula split into the compute's causes and the runtime's (messages,
    Python between the actions, waits beyond the schedule, late starts)."""
    causes = row["residual_by_cause"]
    compute = sum(causes[k] for k in COMPUTE_CAUSES)
    return compute, sum(causes.values()) - compute


def targets(results):
    """The issue's targets, one line per schedule and m; returns the number missed."""
    missed = 0
    print(f"  targets: {'schedule':<17} {'m':>3} {'measured':>8} {'simulated':>9} {'diff':>7} {'formula':>7} {'diff':>7}  "
          f"{'= compute + runtime':>19}  {'message us: latency/send/recv':>29}  verdict")
    for key, row in results.items():
        name, m = key.split("/")[0], row["m"]
        measured, simulated, formula = (row[k] for k in ("measured_bubble_fraction", "simulated_bubble_fraction",
                                                         "formula_bubble_fraction"))
        checks = [("sim", abs(measured - simulated) <= 0.03)]
        if name in ("gpipe", "1f1b") or (name == "interleaved_1f1b" and m == 8):
            checks.append(("formula", abs(measured - formula) <= 0.05))
        below = {"zb_h1": "1f1b", "zbv": "interleaved_1f1b"}.get(name)
        if f"{below}/m{m}" in results:
            checks.append((f"< {below}", measured < results[f"{below}/m{m}"]["measured_bubble_fraction"]))
        missed += sum(not ok for _, ok in checks)
        compute, runtime = formula_gap(row)
        print(f"  targets: {name:<17} {m:>3} {measured:>8.3f} {simulated:>9.3f} {measured - simulated:>+7.3f} "
              f"{formula:>7.3f} {measured - formula:>+7.3f}  {compute:>+9.3f} {runtime:>+9.3f}  "
              f"{row['message_cost_s'] * 1e6:>11.0f}/"
              f"{row.get('message_send_overhead_s', 0) * 1e6:.0f}/{row.get('message_receive_overhead_s', 0) * 1e6:<7.0f}  "
              + ", ".join(f"{label} {'ok' if ok else 'MISSED'}" for label, ok in checks))
    return missed


def plot(all_results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(all_results), figsize=(6 * len(all_results), 4.2), squeeze=False)
    for ax, (p, results) in zip(axes[0], sorted(all_results.items())):
        for i, name in enumerate(SCHEDULES):
            rows = [results[k] for k in results if k.startswith(name + "/")]
            if not rows:
                continue
            ms = [row["m"] for row in rows]
            ax.plot(ms, [row["formula_bubble_fraction"] for row in rows], "-", color=f"C{i}", label=f"{name} formula")
            ax.errorbar(ms, [row["measured_bubble_fraction"] for row in rows], fmt="o", color=f"C{i}",
                        yerr=np.abs(np.array([row["measured_bubble_fraction_spread"] for row in rows]).T -
                                    [row["measured_bubble_fraction"] for row in rows]), capsize=2,
                        label=f"{name} measured (per-step range)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("bubble fraction")
        ax.set_title(f"p = {p}" + (" (oversubscribed: 4 ranks on 2 cores)" if p > 2 else ""))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.at_least(2, "a pipeline has 2 or more stages"), nargs="+",
                    action=cli.Distinct, default=[2, 4],
                    help="pipeline stages: one mpiexec launch per p")
    ap.add_argument("--steps", type=cli.at_least(2, "the first step is not measured"), default=6,
                    help="steps per configuration (the first is not measured)")
    ap.add_argument("--repeat", type=cli.positive_int, default=1, help="runs per configuration (the quietest is reported)")
    ap.add_argument("--wait-quiet", type=cli.nonneg_float, default=0.0, metavar="SHARE",
                    help="before each run, wait until other processes use less than SHARE of the cores (0: do not wait)")
    ap.add_argument("--quiet-timeout", type=cli.positive_float, default=120.0, help="... but no longer than this, in seconds")
    ap.add_argument("--width", type=cli.positive_int, default=1024, help="W of the 8 Linear(W, W) blocks")
    ap.add_argument("--microbatches", type=cli.positive_int, nargs="+", action=cli.Distinct, default=[4, 8, 16],
                    help="values of m")
    ap.add_argument("--schedules", nargs="+", action=cli.Distinct, default=SCHEDULES, choices=SCHEDULES,
                    help="the schedules to run")
    ap.add_argument("--plot", metavar="PNG", type=cli.output_image, help="draw the bubbles beside the formula (default: no plot)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--job", action="store_true", help="run the issue's mlp pipeline job (p = 2) instead of the model here")
    ap.add_argument("--epochs", type=cli.positive_int, default=3, help="--job: the job's epochs")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    given = cli.given_options(ap, None)
    if args.job:
        for option, why in (("--ranks", "the job runs at p = 2"), ("--steps", "the job runs --epochs"),
                            ("--plot", "the job's runs are not drawn")):
            if option in given:
                cli.refuse(ap, option, "--job", why)
    elif "--epochs" in given:
        cli.refuse(ap, "--epochs", "the model here (no --job)", "it runs --steps; --epochs is the job's")
    if "interleaved_1f1b" in args.schedules:
        for p in [2] if args.job else args.ranks:
            odd = [m for m in args.microbatches if m % p]
            if odd:
                ap.error(f"argument --microbatches: interleaved_1f1b takes m divisible by p, and m = {odd[0]} at "
                         f"p = {p} is not (leave interleaved_1f1b out of --schedules, or give other values of m)")
    if not args.job:
        from minitrain.parallel.pipeline.schedules import default_chunks
        layers = LAYERS + 1                 # build()'s Linear layers: the stem's and the blocks' (a stage trains one)
        for p in args.ranks:
            for name in args.schedules:
                stages = p * default_chunks(name, CHUNKS.get(name))
                if stages > layers:
                    ap.error(f"argument --ranks: {name} at p = {p} cuts the model's {layers} Linear layers into "
                             f"{stages} stages, and each needs one (p <= {layers // (stages // p)} with {name})")
    if args.job:
        results = run_job(args)
        print(f"the mlp job at p = 2, hidden {args.width}, batch 256, {args.epochs} epochs; the run of median "
              f"bubble of {args.repeat}")
        targets(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"2": results}, f, indent=1)
        return None
    all_results = {}
    for p in args.ranks:
        results = launch(p, args)
        all_results[p] = results
        single = results.pop("single")
        for row in results.values():
            row["single_process_step_s"], row["speed_up"] = single, single / row["step_time_s"]
        from minitrain.testing import mpi_library_name
        print(f"\np = {p}" + (" (4 ranks on 2 cores: oversubscribed)" if p > 2 else "")
              + f"; one process on the whole batch: {single * 1e3:.1f} ms/step; others: the share of the machine's "
              f"{os.cpu_count()} cores other processes used during the run; MPI: {mpi_library_name()}")
        print(f"  {'schedule':<20} {'m':>3} {'step':>9} {'speed-up':>9} {'bubble':>7} {'per step':>13} {'formula':>8} "
              f"{'diff':>7} {'repeats':>15} {'simulated':>9} {'diff':>7} {'others':>6}  residual by cause (fraction of the step)")
        for key, row in results.items():
            name = key.split("/")[0] + (f" v={row['chunks']}" if row["chunks"] > 1 and "zbv" not in key else "")
            low, high = row["measured_bubble_fraction_spread"]
            runs = [run["measured_bubble_fraction"] - run["formula_bubble_fraction"] for run in row["repeats"]]
            causes = ", ".join(f"{k} {v:+.3f}" for k, v in row["residual_by_cause"].items() if abs(v) >= 0.005)
            measured, simulated = row["measured_bubble_fraction"], row["simulated_bubble_fraction"]
            print(f"  {name:<20} {row['m']:>3} {row['step_time_s'] * 1e3:>7.1f}ms {single / row['step_time_s']:>8.2f}x "
                  f"{measured:>7.3f} {low:>6.3f}-{high:<6.3f} {row['formula_bubble_fraction']:>8.3f} "
                  f"{measured - row['formula_bubble_fraction']:>+7.3f} {min(runs):>+7.3f}..{max(runs):<+6.3f} "
                  f"{simulated:>9.3f} {measured - simulated:>+7.3f} {row['others_cpu_share']:>6.0%}  {causes}")
        targets(results)
    if args.plot:
        plot(all_results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in all_results.items()}, f, indent=1)


if __name__ == "__main__":
    main()

"""What the safety checks cost, measured in the same run: check_collectives (every collective's
header compared across ranks first), the receive-size check (MPI's status count on completion) and
the flight recorder (a record per call, its shared-memory mirror), on the main job's step and on a
bandwidth-bound all-reduce (and, for honesty, a latency-bound one).

    python scripts/bench_checks.py [--ranks 4] [--steps 100] [--rounds 5] [--mib 16] [--json out.json]

Launches itself under mpiexec -n p. The main job's step is examples/mlp.py's default: the MLP
64-128-128-10 on the digits, global batch 64, DDP, Adam, fp32. Four configurations, measured in
turn at every step (interleaved, so that a machine shared with other jobs slows them alike, in
an order rotated each step; the ranks meet at a barrier before each timed call); a
configuration's time is the median over rounds of the slowest rank's median step:

  all         check_collectives + size checks + flight recorder   (every job's default)
  -check      size checks + flight recorder
  -sizes      flight recorder only
  none        nothing
Prints each configuration's time and its ratio to none, and what each mechanism adds; and,
from steadier figures, check_collectives' share of the step: collectives per step (counted) x what
the check adds to a 1 KiB all-reduce.
"""
import argparse
import json
import time

import numpy as np

from minitrain import cli

CONFIGS = {"all": (True, True, True), "-check": (False, True, True), "-sizes": (False, False, True),
           "none": (False, False, False)}          # check_collectives, verify_sizes, recording


def configure(comm, name):
    check, sizes, record = CONFIGS[name]
    comm.check_collectives = check
    comm.verify_sizes = sizes                       # measurement-only switches (mpi.py, flight_recorder.py)
    comm.recorder.recording = record


def worker(args):
    import minitrain
    from minitrain import nn, optim
    from minitrain.comm import init, ring_all_reduce
    from minitrain.data import DataLoader, DistributedSampler, load_digits
    from minitrain.nn import functional as F
    from minitrain.parallel import DistributedDataParallel
    comm = init()
    minitrain.manual_seed(0)
    x_train, y_train, _, _ = load_digits(seed=0)
    model = nn.MLP([64, 128, 128, 10])
    ddp = DistributedDataParallel(model, comm)
    opt = optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader((x_train, y_train), 64 // comm.size,
                        sampler=DistributedSampler(len(x_train), num_replicas=comm.size, rank=comm.rank, seed=0))
    batches = list(loader)

    def train_step(i):
        xb, yb = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(ddp(minitrain.Tensor(xb)), yb).backward()
        opt.step()

    big = np.ones(int(args.mib * (1 << 20)) // 4, np.float32)
    big_out = np.empty_like(big)
    small = np.ones(256, np.float32)
    small_out = np.empty_like(small)
    workloads = {"mlp step": (train_step, args.steps),
                 f"ring all-reduce {args.mib:g} MiB": (lambda i: ring_all_reduce(comm, big, out=big_out), args.big_reps),
                 "ring all-reduce 1 KiB": (lambda i: ring_all_reduce(comm, small, out=small_out), args.steps)}
    times = {w: {c: [] for c in CONFIGS} for w in workloads}
    # what each configuration really did (so that a switch that does nothing cannot pass unseen):
    # header messages sent by check_collectives, records the flight recorder kept (its ring holds 64)
    did = {w: {c: {"header_messages": 0, "recorded_calls": 0} for c in CONFIGS} for w in workloads}
    for w, (fn, reps) in workloads.items():
        for i in range(3):                               # warm up
            fn(i)
        names = list(CONFIGS)
        for k in range(args.rounds):
            mine = {c: [] for c in CONFIGS}
            for i in range(reps):
                # every configuration once per step, in an order rotated each step: a burst of other
                # jobs on a shared machine slows them alike, and no configuration always goes first
                j = (k * reps + i) % len(names)
                for c in names[j:] + names[:j]:
                    configure(comm, c)
                    comm.mpi_comm.Barrier()
                    headers, first = comm.stats["check_collectives"]["messages_sent"], comm._seq
                    t0 = time.perf_counter()
                    fn(i)
                    mine[c].append(time.perf_counter() - t0)
                    did[w][c]["header_messages"] += comm.stats["check_collectives"]["messages_sent"] - headers
                    did[w][c]["recorded_calls"] += sum(r.seq >= first for r in comm.recorder.records
                                                       if r.comm == "world")
            for c in CONFIGS:
                slowest = comm.mpi_comm.allreduce(float(np.median(mine[c])), op=__import__("mpi4py").MPI.MAX)
                times[w][c].append(slowest)
        configure(comm, "all")
    if comm.rank == 0:
        from minitrain.comm import mpi_library
        result = {w: {c: float(np.median(v)) for c, v in per.items()} for w, per in times.items()}
        with open(args.worker_out, "w") as f:
            json.dump({"p": comm.size, "mpi_library": mpi_library(), "seconds": result, "did": did,
                       "rounds": {w: {c: v for c, v in per.items()} for w, per in times.items()}}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--ranks", type=cli.at_least(2, "the checks compare a call with another rank's"), default=4,
                    help="ranks (one mpiexec launch)")
    ap.add_argument("--steps", type=cli.positive_int, default=100, help="steps (and 1 KiB all-reduces) per configuration and round")
    ap.add_argument("--big-reps", type=cli.positive_int, default=10, help="big all-reduces per configuration and round")
    ap.add_argument("--rounds", type=cli.positive_int, default=5, help="rounds; each measures every configuration once")
    ap.add_argument("--mib", type=cli.positive_float, default=16, help="size of the big (bandwidth-bound) all-reduce, MiB")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    from minitrain.testing import run_worker
    out = run_worker(__file__, args.ranks, ["--steps", args.steps, "--big-reps", args.big_reps,
                                            "--rounds", args.rounds, "--mib", args.mib])
    print(f"p = {out['p']} ranks, MPI: {out['mpi_library']}; median over {args.rounds} rounds of the slowest "
          f"rank's median (configurations interleaved step by step)")
    print(f"{'workload':<26}" + "".join(f"{c:>19}" for c in CONFIGS)
          + f"{'check adds':>12}{'sizes add':>11}{'recorder adds':>15}")
    for w, s in out["seconds"].items():
        base = s["none"]
        cells = "".join(f"{s[c] * 1e3:9.3f} ms {s[c] / base:5.2f}x" for c in CONFIGS)
        adds = [(s["all"] - s["-check"]) / s["all"], (s["-check"] - s["-sizes"]) / s["all"],
                (s["-sizes"] - s["none"]) / s["all"]]
        print(f"{w:<26}{cells}" + "".join(f"{a:>+11.1%}" for a in adds) + "    ")
    print("(x: ratio to 'none'; 'adds': share of the default ('all') step each mechanism accounts for; "
          "differences within the rounds' spread are noise)")
    # paired within each round (the configurations ran side by side, step by step): what turning
    # check_collectives off saves, as a share of the default step; the median over rounds
    out["check_share_paired"] = {w: float(np.median([1 - off / on for on, off in zip(r["all"], r["-check"])]))
                                 for w, r in out["rounds"].items()}
    print("check_collectives' share of the default step, paired per round (median over rounds of "
          "1 - t(-check) / t(all)): " + ", ".join(f"{w} {v:+.1%}" for w, v in out["check_share_paired"].items()))
    # the same share from steadier figures: collectives per step x what the check adds to one small
    # (latency-bound) all-reduce, over the step
    step, small = out["seconds"]["mlp step"], out["seconds"]["ring all-reduce 1 KiB"]
    per_step = out["did"]["mlp step"]["all"]["header_messages"] / (args.steps * args.rounds)
    per_call = small["all"] - small["-check"]
    out["check_share_estimate"] = {"collectives_per_step": per_step, "seconds_per_collective": per_call,
                                   "share_of_step": per_step * per_call / step["all"]}
    print(f"check_collectives on the mlp step, estimated: {per_step:g} collective(s) per step x "
          f"{per_call * 1e6:.0f} us each (1 KiB all-reduce, all - -check) = {per_step * per_call / step['all']:.1%} "
          f"of the {step['all'] * 1e3:.3f} ms step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

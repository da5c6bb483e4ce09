"""The end of the MLP job's data-parallel run (examples/mlp.py): every rank's steady-state step split into
compute and exposed communication (report.py), the bytes each rank sent beside the ring's formula
(2(p-1)/p·Ψ·bytes per step; ZeRO-3: 3(p-1)/p·Ψ·bytes), memory per rank beside ZeRO's formula
(Rajbhandari et al. 2020, Figure 1), the test accuracy, and the run's JSON.
"""
from dataclasses import dataclass, field

import numpy as np

import minitrain
from minitrain import backend, memory, trace
from minitrain.backend import LOW_PRECISION
from minitrain.data import split_sizes
from minitrain.examples.common import checks_line, device_code, mpi_line, transport_name
from minitrain.examples.gpt_common import mixed_precision
from minitrain.examples.mlp_common import evaluate, gather_rows, global_losses
from minitrain.examples.report import (device_name, fmt_bytes, gather_steps, memory_table, plan_comparison,
                                       show_plan, write_json)
from minitrain.parallel import check_replicas_equal
from minitrain.parallel.zero_memory import model_state_bytes


@dataclass
class Run:
    """What the training loop leaves for the report."""
    first_step: int = 0
    steps: int = 0
    losses: list = field(default_factory=list)       # every step's loss, on the device until the end
    elapsed: float = 0.0
    scaler: object = None                             # mixed precision: the optimizer that keeps the loss scale


def report(args, comm, model, wrapped, stage, watch, run, test, offload):
    """Every rank gathers its figures and evaluates; rank 0 prints and writes the JSON."""
    world, rank = comm.size, comm.rank
    if stage < 3:                        # under ZeRO-3 each rank holds a different shard, by design
        check_replicas_equal(model, comm)
    rows = split_sizes(args.batch_size, world)          # each rank's share of a full batch (uneven by a row at most)
    persistent, host, peak, t = watch.persistent, watch.host, memory.peak(), watch.figures()
    row = [rows[rank] / t["step_s"] if t["step_s"] else 0.0, t["step_s"], t["compute_s"], t["comm_exposed_s"],
           t["comm_total_s"], comm.stats.bytes_sent / run.steps,
           *[persistent[c] for c in ("params", "grads", "optimizer_state")],
           *[peak[c] for c in memory.CATEGORIES], peak["total"],
           *[host[c] for c in ("params", "grads", "optimizer_state")], device_code()]
    table = gather_rows(comm, row)
    step_by_rank, slowest = gather_steps(comm, watch.timer)
    losses = global_losses(comm, run.losses)
    final_loss = float(np.mean(gather_rows(comm, [float(run.losses[-1])])))
    if args.trace:
        trace.save_chrome(args.trace, comm)
    # every rank evaluates: under ZeRO-3 the forward all-gathers each unit, a collective
    accuracy = evaluate(wrapped if stage == 3 else model, *test, args.dtype)
    if rank != 0:
        return 0

    psi, itemsize = model.num_parameters(), args.dtype.itemsize
    formula = (3 if stage == 3 else 2) * (world - 1) / world * psi * itemsize
    if args.strategy == "local_sgd":
        formula /= args.sync_every
    # optimizer state bytes per parameter: the moments in fp32 (or fp64), plus fp32 master weights
    # in mixed precision (Adam: K = 12, the paper's figure) or the host copy with --offload
    state_item = 4 if args.dtype in LOW_PRECISION else itemsize
    k = {"adam": 2, "sgd": 1}[args.optimizer] * state_item + (state_item if args.dtype in LOW_PRECISION or args.offload else 0)
    state_formula = model_state_bytes(psi, world, stage, param_bytes=itemsize, grad_bytes=itemsize, k=k)
    step = table[:, 1].max()             # a step ends when its slowest rank's does
    samples = args.batch_size / step if step else 0.0
    print(f"\nMLP {model.sizes} ({psi:,} parameters), {args.strategy} on {world} rank(s) "
          f"[{minitrain.backend.describe_device()} on rank 0, transport {transport_name(comm)}], {args.optimizer}, "
          f"{args.epochs} epochs, global batch {args.batch_size} ({'-'.join(map(str, sorted(set(rows))))} per rank), {args.precision}")
    print(f"final loss {final_loss:.4f}   test accuracy {accuracy:.2%}   {speed_text(samples)}   {run.elapsed:.1f} s")
    print(f"MPI: {mpi_line()}; {checks_line(args)}")
    print(f"\n{'rank':>4} {'device':>7} {'samples/s':>10} {'step':>9} {'compute':>9} {'comm exposed':>13} "
          f"{'comm total':>11} {'sent/step':>10} {'formula':>10} {'peak memory':>12}")
    for r, v in enumerate(table):
        print(f"{r:>4} {device_name(v[18]):>7} {v[0]:>10,.0f} {v[1] * 1e3:>7.2f}ms {v[2] * 1e3:>7.2f}ms "
              f"{v[3] * 1e3:>11.2f}ms {v[4] * 1e3:>9.2f}ms {fmt_bytes(v[5]):>10} {fmt_bytes(formula):>10} "
              f"{fmt_bytes(v[14]):>12}")
    steady = watch.steady_state()
    print(f"\n(steady state: medians over the steps after the first {steady['skipped_first_steps']}, the step timer's "
          "own work left out.\n step = compute + comm exposed, the time the loop waited for a collective; comm total: "
          "the time a\n collective ran or was waited for, overlapping backward; sent/step averages every message, the "
          "start-up\n broadcast included; formula: " + ("3" if stage == 3 else "2") + "(p-1)/p·Ψ·bytes"
          + (f" / {args.sync_every}" if args.strategy == "local_sgd" else "")
          + "; peak memory: every category, by rank, in --json)")
    compared = plan_comparison(args, world, slowest, table[:, 14].max())
    show_plan(args, compared)
    print(f"\nrecompute: {args.recompute}; peak saved activations {fmt_bytes(peak['activations'])}"
          + (f"; offloaded {fmt_bytes(offload.bytes_offloaded / run.steps)} per step" if offload else ""))
    print("memory on rank 0 (model states at the optimizer step; peak over the run):")
    print(memory_table(persistent, peak))
    if args.offload:
        print(f"  on the host (offloaded): params {fmt_bytes(host['params'])}, grads {fmt_bytes(host['grads'])}, "
              f"optimizer_state {fmt_bytes(host['optimizer_state'])}")
    print(f"  ZeRO formula, stage {stage}: params {fmt_bytes(state_formula['params'])}, grads "
          f"{fmt_bytes(state_formula['grads'])}, optimizer_state {fmt_bytes(state_formula['optimizer_state'])}"
          " (measured: 'at step' above; padding and ZeRO-3's placeholders add a few bytes"
          + ("; --offload puts optimizer_state, and under zero3 params and grads, on the host" if args.offload else "")
          + ")")
    ranks = [{"rank": r, "device": device_name(v[18]), "samples_per_second": v[0], "step_seconds": v[1],
              "compute_seconds_per_step": v[2], "comm_exposed_seconds_per_step": v[3],
              "comm_total_seconds_per_step": v[4], "bytes_sent": v[5] * run.steps,
              "memory": {"persistent": dict(zip(("params", "grads", "optimizer_state"), map(int, v[6:9]))),
                         "peak": dict(zip(list(memory.CATEGORIES) + ["total"], map(int, v[9:15]))),
                         "host": dict(zip(("params", "grads", "optimizer_state"), map(int, v[15:18])))},
              "step": step_by_rank[r]} for r, v in enumerate(table)]
    if args.json:
        write_json(args.json, {
            "world_size": world, "mpi_library": mpi_line(), "comm_timeout": args.comm_timeout,
            "check_collectives": comm.check_collectives, "strategy": args.strategy,
            "num_params": psi, "final_loss": final_loss, "transport": transport_name(comm),
            "test_accuracy": accuracy, "samples_per_second": samples, "steps": run.steps,
            "steady_state": steady,
            "elapsed_seconds": run.elapsed,
            "bytes_per_step": float(np.mean(table[:, 5])), "bytes_per_step_formula": formula,
            "memory_formula": state_formula, "precision": args.precision, "offload": args.offload,
            "recompute": args.recompute, "offload_activations": args.offload_activations,
            "bytes_offloaded_per_step": offload.bytes_offloaded / run.steps if offload else 0,
            **slowest, "blas_threads": backend.blas_threads(), "ranks": ranks, "planner": compared,
            "first_step": run.first_step, "losses": losses, **mixed_precision(run.scaler)})
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        trace.plot_timeline([e for e in watch.last_step_events if e["kind"] != "step"],
                            title=f"rank 0, last step: compute and each bucket's all-reduce ({args.strategy})")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
    return 0


def speed_text(samples):
    """The steady-state speed, or why there is none: a run resumed at an epoch's short last batch times no step
    (its rows are not --batch-size's)."""
    return (f"{samples:,.0f} samples/s in all (steady state)" if samples
            else "no step timed (the run's only step was an epoch's short last batch)")

"""What the example jobs share: where this process sits in an mpirun launch, and the report.

Until data parallelism lands (issue 4), a job started as mpirun -n N trains on rank 0 and the
other ranks exit at once; the launch is read from the MPI launcher's environment (MPICH's
PMI_RANK/PMI_SIZE, Open MPI's OMPI_COMM_WORLD_*), so no MPI is initialised for a 1-process job.
"""
import json
import os

from .. import backend, memory

try:                                   # the progress bar is optional: without tqdm, no bar
    from tqdm import tqdm
except ImportError:                    # pragma: no cover - depends on the machine
    class tqdm:                        # noqa: N801  (tqdm's name and the calls the jobs make)
        def __init__(self, iterable=None, **kwargs):
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

        def update(self, n=1):
            pass

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            pass

MODEL_STATE = ("params", "grads", "optimizer_state")


def launch_info():
    """(rank, size) of this process in the launcher's world; (0, 1) when started directly."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ.get(size_var, "1"))
    return 0, 1


def device_code():
    """This rank's device as a number for the per-rank tables: the GPU index, or -1 for the CPU."""
    return backend.gpu_index() if backend.get_device() == "cuda" else -1


def device_name(code):
    return "cpu" if code < 0 else f"cuda:{int(code)}"


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def persistent_memory():
    """Model-state bytes live right now (call it at the optimizer step)."""
    live = memory.snapshot()
    return {c: live[c] for c in MODEL_STATE}


def memory_table(persistent, peak):
    rows = [f"  {'category':<16}{'at step':>12}{'peak':>12}"]
    for c in memory.CATEGORIES:
        rows.append(f"  {c:<16}{fmt_bytes(persistent.get(c, 0)):>12}{fmt_bytes(peak[c]):>12}")
    rows.append(f"  {'total':<16}{fmt_bytes(sum(persistent.values())):>12}{fmt_bytes(peak['total']):>12}")
    return "\n".join(rows)


def write_json(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def planner_line(args, world, step_time, peak_total, kind="mlp", vocab_size=None):
    """The planner's prediction for this job's options beside what the job measured (minitrain/plan)."""
    from .. import plan
    try:
        model, layout = (plan.mlp_from_args(args, world) if kind == "mlp"
                         else plan.gpt_from_args(args, world, vocab_size))
        predicted = plan.predict(model, layout)
    except plan.LayoutError as e:
        return f"planner: refuses this layout ({e})"
    return (f"planner (python -m minitrain.plan {kind} <these options> --world {world}): step "
            f"{predicted['step_time_s']['total'] * 1e3:.2f} ms predicted, {step_time * 1e3:.2f} ms measured (median, "
            f"slowest rank); peak memory per rank {fmt_bytes(predicted['memory_bytes']['total'])} predicted, "
            f"{fmt_bytes(peak_total)} measured")

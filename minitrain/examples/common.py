"""What the example jobs share: where this process sits in an mpirun launch, the options every job
takes (--comm-timeout), argument parsing that speaks once for N ranks, and the report.

The launch is read from the MPI launcher's environment (MPICH's PMI_RANK/PMI_SIZE, Open MPI's
OMPI_COMM_WORLD_*), so no MPI is initialised for a 1-process job and a bad option is reported by
rank 0 alone before MPI starts.
"""
import argparse
import json
import os

from .. import backend, cli, memory
from ..comm.communicator import DEFAULT_COMM_TIMEOUT

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


def transport_name(comm):
    """How this job's device buffers cross ranks (minitrain/comm/transport.py), for its table and JSON."""
    from ..comm.transport import describe
    return describe(comm)


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


# ---------------------------------------------------------------- what every job takes and how it starts
class JobArgumentParser(argparse.ArgumentParser):
    """argparse for a job started as N processes: usage, help and errors are printed once (by the
    launcher's rank 0), and every rank exits with argparse's status (2 for a bad option)."""

    def _print_message(self, message, file=None):
        if launch_info()[0] == 0:
            super()._print_message(message, file)


def add_job_options(parser):
    """The options every example takes (colleagues: add yours beside these)."""
    parser.add_argument("--comm-timeout", type=float, default=DEFAULT_COMM_TIMEOUT, metavar="SECONDS",
                        help="stall threshold: a wait this long makes the ranks compare their flight records "
                             "(a rank at another call ends the job at once); any wait ends the job at 3x this")
    return parser


def job_parser(description):
    return add_job_options(JobArgumentParser(description=description, formatter_class=cli.HelpFormatter))


def parse_job_args(parser, argv=None):
    """``parser.parse_args`` (printed once, exit status 2 on every rank), plus the common checks."""
    if not isinstance(parser, JobArgumentParser):
        parser.__class__ = type("Job" + type(parser).__name__, (JobArgumentParser, type(parser)), {})
    args = parser.parse_args(argv)
    if not args.comm_timeout > 0:
        parser.error(f"--comm-timeout must be a positive number of seconds, got {args.comm_timeout:g}")
    return args


def init_comm(args):
    """``minitrain.comm.init`` with the job's options: check_collectives on, stall threshold
    ``--comm-timeout``, hard timeout 3x that."""
    from .. import comm
    return comm.init(comm_timeout=args.comm_timeout, check_collectives=True)


def mpi_line():
    """The MPI the job ran on, for its table (MPI_Get_library_version, never a fixed string)."""
    from ..comm import mpi_library
    return mpi_library()

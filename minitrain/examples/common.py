"""What the example jobs share: where this process sits in an mpirun launch, the options every job
takes (--comm-timeout), argument parsing that speaks once for N ranks, the step timer, and the
report (memory table, the planner's prediction beside what was measured, JSON).

The launch is read from the MPI launcher's environment (MPICH's PMI_RANK/PMI_SIZE, Open MPI's
OMPI_COMM_WORLD_*), so no MPI is initialised for a 1-process job and a bad option is reported by
rank 0 alone before MPI starts. StepTimer times each step by the wall clock and by its own thread's
CPU time outside its waits for peers, in units of a fixed anchor workload (plan/overheads.py), which
is what plan/validate.py compares with the planner on a shared machine.
"""
import argparse
import json
import math
import os
import resource
import time

import numpy as np
from tqdm import tqdm  # noqa: F401  (the jobs import it from here; a dependency in setup.cfg)

from .. import backend, cli, memory
from ..autograd.function import nodes_recorded
from ..comm.communicator import DEFAULT_COMM_TIMEOUT, waiting_cpu_seconds

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


def _page_faults():
    """Minor page faults of this thread so far: pages of new memory it touched (Linux; else the process's)."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


class StepTimer:
    """Measures each step (``with timer: ...``): the wall clock; the CPU time of this thread (time.thread_time)
    and, within it, the CPU time spent polling for peers (``comm.communicator.waiting_cpu_seconds``); the page
    faults (new memory first touched); the autograd nodes recorded. On a machine shared with other jobs the wall
    clock counts their turns on the cores, and the polling how often a waiting thread is handed the core back;
    the rest of the thread's CPU time, the step's own work ("busy"), they only slow through the caches and the
    memory bus. So on the CPU the timer also runs the planner's anchor (a fixed workload: plan.overheads.anchor)
    after each of the first 20 steps and every 10th after, and reports each such step's busy time over its
    anchor's: the step in anchors, which the load moves little (both slow down together). Their lower
    quartile (``step_busy_per_anchor``) is compared with the planner, whose constants are each the best of
    several measurements, so it predicts a step at its least disturbed: the lower quartile is that without
    trusting one lucky pair. The median (``step_busy_per_anchor_median``) is reported beside it: it also
    counts the steps disturbed more than their anchor, and runs higher (1-18% in the README's table). The wall
    clock in anchors (``step_wall_per_anchor``, the median of the same pairs) takes out how fast the machine ran
    its one-thread work meanwhile (a VM's host or a neighbour's caches: the anchor ran 1.06-1.63x its calibrated
    time in one hour on this machine), not the turns other jobs take on the cores. ``summary()``:
    medians and fastest steps (the first step, which allocates the optimizer's state, is never the fastest),
    the anchor's fastest run, the counts' medians."""

    KEYS = ("step_time_s", "step_time_min_s", "step_cpu_time_s", "step_cpu_time_min_s", "step_busy_cpu_time_s",
            "step_busy_cpu_time_min_s", "step_waiting_cpu_time_s", "step_page_faults", "step_autograd_nodes",
            "anchor_cpu_time_s", "step_busy_per_anchor", "step_busy_per_anchor_median", "step_wall_per_anchor")

    def __init__(self):
        self.steps, self.anchors = [], []
        self.anchoring = backend.get_device() == "cpu"
        self.counted = True

    def __call__(self, counted=True):
        """``with timer(counted=False)``: a step left out of the figures (an epoch's short last batch)."""
        self.counted = counted
        return self

    @staticmethod
    def _now():
        return (time.perf_counter(), time.thread_time(), waiting_cpu_seconds(), _page_faults(), nodes_recorded())

    def __enter__(self):
        self._start = self._now()
        return self

    def __exit__(self, kind, value, tb):
        end = self._now()
        counted, self.counted = self.counted, True
        if kind is None and counted:
            self.steps.append([b - a for a, b in zip(self._start, end)])
            self.steps[-1][4] -= 1                  # nodes_recorded() takes one number itself
            if self.anchoring and (len(self.steps) <= 20 or len(self.steps) % 10 == 0):
                from ..plan.overheads import anchor
                from threadpoolctl import threadpool_limits
                with threadpool_limits(limits=1):
                    anchor()                        # once to bring its arrays back into the caches, as calibrated
                    started = time.thread_time()
                    anchor()
                    self.anchors.append((len(self.steps) - 1, time.thread_time() - started))
        return False

    def values(self):
        """The summary as a list in KEYS' order (for the jobs' per-rank tables)."""
        wall, cpu, waiting, faults, nodes = np.array(self.steps, np.float64).T
        busy = cpu - waiting
        anchored = [(i, t) for i, t in self.anchors if i > 0 and t > 0] or [(0, math.inf)]   # not the first step
        paired = [busy[i] / t for i, t in anchored]
        return [float(f(x)) for x, f in ((wall, np.median), (wall, np.min), (cpu, np.median), (cpu, np.min),
                                         (busy, np.median), (busy, np.min), (waiting, np.median),
                                         (faults, np.median), (nodes, np.median))] + \
            [min((t for _, t in self.anchors), default=0.0), float(np.percentile(paired, 25)),
             float(np.median(paired)), float(np.median([wall[i] / t for i, t in anchored]))]

    def summary(self):
        return dict(zip(self.KEYS, self.values()))


def gather_steps(comm, timer):
    """Every rank's StepTimer summary (every rank calls it): (a dict per rank, the slowest rank's value of
    each key: a step ends when its slowest rank does)."""
    from .. import comm as mtcomm
    mine = np.array(timer.values(), np.float64)
    table = mtcomm.ring_all_gather(comm, mine, total=mine.size * comm.size).reshape(comm.size, -1)
    return ([dict(zip(StepTimer.KEYS, map(float, row))) for row in table],
            dict(zip(StepTimer.KEYS, map(float, table.max(axis=0)))))


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


def planner_line(args, world, steps, peak_total, kind="mlp", vocab_size=None):
    """The planner's prediction for this job's options beside what the job measured (minitrain/plan): ``steps``
    is the slowest rank's StepTimer summary; the planner is told the BLAS threads this process runs with. Time is
    compared as plan/validate.py compares it: the step's busy CPU time in units of the anchor (which the machine's
    other jobs slow alike) against the planner's compute and its collectives' own work; the wall clock beside
    (also in anchors)."""
    from .. import plan
    try:
        model, layout = (plan.mlp_from_args(args, world) if kind == "mlp"
                         else plan.gpt_from_args(args, world, vocab_size))
        layout = plan.Layout(**{**layout.fields(), "threads": backend.blas_threads() or 0})
        machine = plan.load_machine()
        predicted = plan.predict(model, layout, machine)
    except plan.LayoutError as e:
        return f"planner: refuses this layout ({e})"
    busy = steps["step_busy_per_anchor"] * machine.get("anchor_cpu_time_s", 0.0)
    measured = (f"{busy * 1e3:.2f} ms measured (the step's own thread, in anchors)" if busy
                else f"{steps['step_busy_cpu_time_min_s'] * 1e3:.2f} ms measured (fastest step)")
    in_anchors = steps.get("step_wall_per_anchor", 0.0) * machine.get("anchor_cpu_time_s", 0.0)
    wall = f"; {in_anchors * 1e3:.2f} ms in anchors" if in_anchors else ""
    if layout.threads > 1:                  # the other BLAS threads' work is not this thread's CPU time
        measured += f" with {layout.threads} BLAS threads (OMP_NUM_THREADS=1 to compare)"
    return (f"planner (python -m minitrain.plan {kind} <these options> --world {world}): step busy CPU "
            f"{predicted['step_busy_s'] * 1e3:.2f} ms predicted, {measured}; wall "
            f"{predicted['step_time_s']['total'] * 1e3:.2f} ms predicted, {steps['step_time_s'] * 1e3:.2f} ms measured "
            f"(median, slowest rank{wall}); peak memory per rank {fmt_bytes(predicted['memory_bytes']['total'])} predicted, "
            f"{fmt_bytes(peak_total)} measured")


# ---------------------------------------------------------------- what every job takes and how it starts
class JobArgumentParser(argparse.ArgumentParser):
    """argparse for a job started as N processes: usage, help and errors are printed once (by the
    launcher's rank 0), and every rank exits with argparse's status (2 for a bad option)."""

    def _print_message(self, message, file=None):
        if launch_info()[0] == 0:
            super()._print_message(message, file)


def add_job_options(parser):
    """The options every example takes (each job adds its own after these)."""
    parser.add_argument("--comm-timeout", type=cli.positive_float, default=DEFAULT_COMM_TIMEOUT, metavar="SECONDS",
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
    ``--comm-timeout``, hard timeout 3x that; comm.init also picks the backend and the device transport
    (MINITRAIN_BACKEND, MINITRAIN_TRANSPORT; default mpi and auto)."""
    from .. import comm
    return comm.init(comm_timeout=args.comm_timeout, check_collectives=True)


def mpi_line():
    """The MPI the job ran on, for its table (MPI_Get_library_version, never a fixed string)."""
    from ..comm import mpi_library
    return mpi_library()

"""The step timer (examples/report.py's StepWatch runs it around every step): each step's wall clock, its
thread's CPU time outside its waits for peers, in units of a fixed anchor workload (plan/anchor.py),
which is what plan/validate.py compares with the planner on a shared machine. Its figures are steady state:
medians over the steps after the first WARMUP_STEPS, the anchor's own time never inside a step.
"""
import math
import resource
import time

import numpy as np

from .. import backend
from ..autograd.function import nodes_recorded
from ..comm.waiting import waiting_cpu_seconds

WARMUP_STEPS = 3        # left out of the medians: the optimizer's state allocated, the caches warmed


def _page_faults():
    """Minor page faults of this thread so far: pages of new memory it touched (Linux; else the process's)."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


class StepTimer:
    """Measures each step (``with timer: ...``): the wall clock; the CPU time of this thread (time.thread_time)
    and, within it, the CPU time spent polling for peers (``comm.waiting.waiting_cpu_seconds``); the page
    faults (new memory first touched); the autograd nodes recorded. On a machine shared with other jobs the wall
    clock counts their turns on the cores, and the polling how often a waiting thread is handed the core back;
    the rest of the thread's CPU time, the step's own work ("busy"), they only slow through the caches and the
    memory bus. So on the CPU the timer also runs the planner's anchor (a fixed workload: plan.anchor.anchor)
    after each of the first 20 steps and every 10th after, and reports each such step's busy time over its
    anchor's: the step in anchors, which the load moves little (both slow down together). Their lower
    quartile (``step_busy_per_anchor``) is compared with the planner, whose constants are each the best of
    several measurements, so it predicts a step at its least disturbed: the lower quartile is that without
    trusting one lucky pair. The median (``step_busy_per_anchor_median``) is reported beside it: it also
    counts the steps disturbed more than their anchor, and runs higher (1-18% in the README's table). The wall
    clock in anchors (``step_wall_per_anchor``, the median of the same pairs) takes out how fast the machine ran
    its one-thread work meanwhile (a VM's host or a neighbour's caches: the anchor ran 1.06-1.63x its calibrated
    time in one hour on this machine), not the turns other jobs take on the cores. ``summary()``:
    medians and fastest steps over the steady steps (steady(); the first step, which allocates the optimizer's state, is never the fastest),
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
                from ..plan.anchor import anchor
                from threadpoolctl import threadpool_limits
                with threadpool_limits(limits=1):
                    anchor()                        # once to bring its arrays back into the caches, as calibrated
                    started = time.thread_time()
                    anchor()
                    self.anchors.append((len(self.steps) - 1, time.thread_time() - started))
        return False

    @staticmethod
    def steady(n):
        """The steps a median is taken over, of ``n`` timed: all but the first WARMUP_STEPS (at least one kept)."""
        return slice(min(WARMUP_STEPS, max(n - 1, 0)), None)

    def values(self):
        """The summary as a list in KEYS' order (for the jobs' per-rank tables); steady state (steady()). No step
        timed (a resumed run whose only step was an epoch's short last batch): zeros, as StepWatch.figures() gives."""
        if not self.steps:
            return [0.0] * len(self.KEYS)
        keep = self.steady(len(self.steps))
        wall, cpu, waiting, faults, nodes = np.array(self.steps, np.float64)[keep].T
        busy = cpu - waiting
        first = max(keep.start, 1)                   # never the first step, which allocates the optimizer's state
        anchored = [(i - keep.start, t) for i, t in self.anchors if i >= first and t > 0] or [(0, math.inf)]
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

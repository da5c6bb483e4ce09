"""The anchor: a fixed workload with what a step does, which calibrate times on the quiet machine and the jobs
run between steps: its time in a run over its calibrated time says how much a shared machine's other jobs
slowed that run's own work; its median over its best, how much slower a job's median step computes than the
calibrated best cases (time.typical).
"""
import time

import numpy as np

from .microbench import _best


_ANCHOR = {}


def anchor():
    """A fixed workload with what a step does, on the calling thread (the CPU, one BLAS thread): a tiny GPT's
    forward and backward (graph nodes, small ops), GELU forward and backward on 128K floats (memory-bound),
    four 128^3 matmuls. ``calibrate`` stores its CPU time on the quiet machine (``anchor_cpu_time_s``); the
    jobs run it between steps (examples/step_timer.StepTimer) and report its fastest time: their ratio is how
    much the other jobs on a shared machine slowed this run's own CPU work (caches, memory bandwidth). Its
    arrays are counted on a ledger of its own (the job's memory figures leave it out)."""
    from .. import memory
    if "run" not in _ANCHOR:
        _ANCHOR["ledger"] = memory.MemoryTracker()
        with memory.use_tracker(_ANCHOR["ledger"]):
            _build_anchor()
    with memory.use_tracker(_ANCHOR["ledger"]):
        return _ANCHOR["run"]()


def _build_anchor():
    from .. import nn, random
    from ..autograd import ops
    from .ops import _function
    with random.use_generator(random.fork()):
        gpt = nn.GPT(nn.GPTConfig(vocab_size=8, block_size=4, n_layer=2, n_head=2, n_embd=8))
    rng = np.random.default_rng(0)
    tokens = np.zeros((1, 4), np.int64)
    a, b = (rng.standard_normal((128, 128)).astype(np.float32) for _ in range(2))
    gelu, gelu_back, node = _function(ops.GELU, [rng.standard_normal((2048, 64)).astype(np.float32)])

    def run():
        loss = gpt(tokens, tokens)[1]
        gpt.zero_grad()
        loss.backward()
        gelu()
        gelu_back()
        for _ in range(4):
            a @ b
    _ANCHOR["run"], _ANCHOR["node"] = run, node


def measure_anchor(repeats=20):
    """The anchor's CPU time, best of ``repeats``."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1):
        return _best(anchor, repeats, lambda: None, time.thread_time)


def typical_over_best(comm=None, repeats=40, sleep=0.0):
    """How much slower a job's median step does its CPU work than the calibrated best case: the anchor's CPU
    time, ``repeats`` runs each after a run that brings its arrays back into the caches (as the jobs'
    StepTimer runs it), their median over their fastest (one series: a load that drifts cancels). With
    ``comm``: every rank at once, each run after a barrier (every core busy, as in a job whose ranks fill the
    cores), the median over the runs of the slowest rank's time: what a job's ranks compute before they meet
    at a collective, the later one setting the pace (so the planner prices a collective at its best case:
    time.collective). CPU time, which other processes' turns on the cores leave out: on this 2-core machine
    1.04-1.08x alone and 1.1-1.2x with both cores working (a collective timed in a job after the anchor ran
    2-3x its best case quiet, and 5 ms instead of 0.05-0.3 ms while others took half the cores). ``sleep``:
    each timed run after that long asleep, as a pipeline's stage computes once its input has come (WAIT_S):
    a VM whose idle core the host lends runs it slower again, with both cores working (alone, no slower)."""
    from threadpoolctl import threadpool_limits
    from .. import comm as mtcomm
    times = []
    with threadpool_limits(limits=1):
        for _ in range(repeats):
            if comm is not None:
                comm.barrier()
            anchor()
            if sleep:
                time.sleep(sleep)
            start = time.thread_time()
            anchor()
            times.append(time.thread_time() - start)
    every = np.array([times])
    if comm is not None:                             # each run's slowest rank: the one the others wait for
        every = mtcomm.ring_all_gather(comm, every[0], total=len(times) * comm.size).reshape(comm.size, -1)
    return float(np.median(every.max(axis=0)) / every.min())

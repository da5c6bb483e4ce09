"""What the library's parallel wrappers cost as a real 2-rank job meets them (python -m minitrain.plan calibrate
measures it under mpiexec; time.py charges it): DDP per step and per gradient byte, FSDP per unit, a
pipeline's runtime per action and per byte it sends or receives, and one of its stage-to-stage messages as
the runtime meets it (the schedule's simulator puts it between stages: plan/bubble.py). Their collectives
run on the progress thread beside the step, their sends and receives go through MPI: several times what a
one-rank ThreadWorld shows (plan/overheads.py).
"""
import time

import numpy as np

from .anchor import typical_over_best
from .microbench import _best

WAIT_S = 5e-4      # a pipeline stage's wait for its input, asleep in the poll, before it computes


def measure_in_a_job(comm, repeats=30, typical_runs=None):
    """Under mpiexec -n 2: what DDP, FSDP and a pipeline's runtime add to the CPU time a step's own thread spends
    outside its waits (busy), beyond the plain model's: per step and per byte of gradient for DDP, per unit for
    FSDP, per action and per byte of the activation it sends or receives for a pipeline, and what one of its
    stage-to-stage messages takes (fixed and per byte: _pipeline_action, 2-128 KiB). Measured in a real
    job, where DDP's and FSDP's collectives run on the progress thread beside the step's own thread and a
    pipeline's messages go through MPI: on this 2-core machine DDP added 0.15-0.24 ms a step, FSDP 0.3-0.4 ms
    a unit and a pipeline 4-14 us an action with 2-64 KiB activations, 60-100 us with 128 KiB, several times
    what a one-rank ThreadWorld, whose collectives move nothing, shows."""
    from .. import nn
    from ..autograd import Tensor
    from ..parallel import DistributedDataParallel, FullyShardedDataParallel

    def busy(module, x, y):
        def step():
            loss = nn.functional.cross_entropy(module(x), y)
            for q in module.parameters():
                q.grad = None
            loss.backward()
        return _best_busy(step, repeats)
    rng = np.random.default_rng(comm.rank)
    x, y = Tensor(rng.standard_normal((32, 64)).astype(np.float32)), rng.integers(0, 10, 32)
    points = []
    for width in (16, 512):
        model = nn.MLP([64, width, width, 10])
        plain = busy(model, x, y)
        wrapped = busy(DistributedDataParallel(model, comm), x, y)
        points.append((4 * model.num_parameters(), wrapped - plain))
    (b0, t0), (b1, t1) = points
    per_byte = max(0.0, (t1 - t0) / (b1 - b0))
    units, x16 = 8, Tensor(rng.standard_normal((32, 16)).astype(np.float32))
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(units - 1)], nn.Linear(16, 10))
    plain = busy(model, x16, y)
    sharded = busy(FullyShardedDataParallel(model, comm), x16, y)
    piped = [(4 * 32 * w, *_pipeline_action(comm, repeats, w)) for w in (16, 128, 512, 1024)]
    action, message = _line([(n, a) for n, a, _ in piped], alone="per_byte"), _line([(n, m) for n, _, m in piped])
    mine = np.array([max(0.0, t0 - per_byte * b0), per_byte, max(0.0, sharded - plain) / units, *action, *message])
    from .. import comm as mtcomm
    slowest = mtcomm.all_reduce(comm, mine, op="max")
    return {"ddp_step_s": float(slowest[0]), "ddp_byte_s": float(slowest[1]), "fsdp_unit_s": float(slowest[2]),
            "pipeline_action_s": float(slowest[3]), "pipeline_action_byte_s": float(slowest[4]),
            "pipeline_message_s": float(slowest[5]), "pipeline_message_byte_s": float(slowest[6]),
            **_typical_in_a_job(comm, typical_runs)}


def typical_series(comm):
    """One series each of anchor.typical_over_best on both ranks at once, without and with a wait asleep
    before each run: (job, waited)."""
    return typical_over_best(comm, 100), typical_over_best(comm, 100, WAIT_S)


def _typical_in_a_job(comm, runs=None, series=3):
    """typical_job and typical_job_waited, each the median of its series (``runs``: taken by the caller, seconds
    apart; else ``series`` taken here in turn): one series of 100 runs read 1.06 to 1.21 from one calibration to
    the next, and a spell of the machine that slows a single series (one calibration priced every pipeline 1.4x
    its busy CPU) is outvoted by the other two."""
    runs = runs or [typical_series(comm) for _ in range(series)]
    job, waited = np.median(np.array(runs), axis=0)
    return {"typical_job": float(job), "typical_job_waited": float(waited)}


def _line(points, alone="per_call"):
    """(a, b) >= 0 of t = a + b·n over [(n, t)], least squares in relative error (as calibrate's alpha-beta
    fits: a small message counts as much as a large one); points at t = 0 (nothing measured) left out. A
    point left alone is a per-call cost (a message's latency) or, ``alone="per_byte"``, a per-byte one (a
    runtime's cost that shows only at the largest activation: taken per call, one 128 KiB point priced
    every action of a small job at ~100 us, 1.3-1.6x its step)."""
    points = [(n, t) for n, t in points if t > 0]
    if len(points) < 2:
        if points and alone == "per_byte":
            return 0.0, points[0][1] / points[0][0]
        return (points[0][1] if points else 0.0), 0.0
    n, t = np.array(points, np.float64).T
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, n / t], axis=1), np.ones_like(t), rcond=None)
    if b < 0:
        return float(np.median(t)), 0.0
    if a < 0:
        return 0.0, float(np.median(t / n))
    return float(a), float(b)


def _busy_cpu():
    """This thread's CPU time outside its waits for peers (what the jobs' step timer calls busy)."""
    from ..comm.waiting import waiting_cpu_seconds
    return time.thread_time() - waiting_cpu_seconds()


def _paired_busy(fn, baseline, repeats):
    """The median over ``repeats`` pairs, run back to back, of ``fn``'s busy CPU less ``baseline``'s (after one
    warm-up call of each): a slow spell of the machine slows both halves of a pair alike. (The difference
    of each one's best of 30 read 0 or 100 us an action from one calibration to the next.)"""
    def busy(f):
        t = _busy_cpu()
        f()
        return _busy_cpu() - t
    fn(), baseline()
    return float(np.median([busy(fn) - busy(baseline) for _ in range(repeats)]))


def _best_busy(fn, repeats):
    """The least busy CPU of ``repeats`` calls of ``fn``, after one call to warm it up."""
    return _best(fn, repeats, lambda: None, _busy_cpu)


def _pipeline_action(comm, repeats, width, m=8, rows=32):
    """(busy CPU per action, seconds per message) of a two-stage 1F1B pipeline whose activations are ``rows``
    x ``width`` floats, traced as the jobs trace it. Per action, beyond the stage's own forward and backward
    run directly: the runtime's bookkeeping, its sends and receives (header and array, outside their waits),
    a backward call per micro-batch, the spans. Per message: what the job's own measure reports
    (parallel/pipeline/measure.message_costs: the latency from the send posted to the waiting receiver
    having it: the copy, the waiter waking from its poll; posting the send and taking a message are in
    the action's busy cost above), which the schedule's simulator puts between a stage and the next
    (time.py). Several times a blocking receive's best case (the p2p fit): a waiter sleeps between polls."""
    from .. import nn, trace
    from ..autograd import Tensor
    from ..parallel.pipeline import PipelineParallel
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 10))
    pipe = PipelineParallel(model, comm, "1f1b", num_microbatches=m)
    stage = pipe.stages[0]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((rows * m, width)).astype(np.float32), rng.integers(0, 10, rows * m)
    received = [rng.standard_normal((rows, width)).astype(np.float32) for _ in range(m)]

    def direct():                                  # this rank's stage alone, the same micro-batches, each
        for i in range(m):                         # compute after a wait asleep, as the runtime's (WAIT_S)
            time.sleep(WAIT_S)
            if comm.rank == 0:
                out = stage(Tensor(x[rows * i:rows * (i + 1)]))
                time.sleep(WAIT_S)
                out.backward(received[i])
            else:
                out = stage(Tensor(received[i], requires_grad=True))
                (nn.functional.cross_entropy(out, y[rows * i:rows * (i + 1)]) * (1.0 / m)).backward()
    trace.enable(rank=comm.rank)
    extra = _paired_busy(lambda: pipe.train_step(x, y, nn.functional.cross_entropy), direct, repeats)
    from ..parallel.pipeline.measure import summarize
    message = summarize(pipe)["message_cost_s"]            # the same on both ranks (a collective)
    trace.disable()
    trace.tracer().events.clear()
    return max(0.0, extra) / (2 * m), message

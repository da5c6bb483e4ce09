"""The Python a step pays beyond its arithmetic, measured as the library's own code runs (plan calibrate
stores it; time.py charges it): per graph node and per parameter given its first gradient (a tiny GPT and a
tiny MLP, their ops' costs subtracted); in a real 2-rank job, what DDP adds per step and per gradient byte,
FSDP per unit and a pipeline runtime per action (their collectives on the progress thread beside the step,
their sends and receives). And the anchor: a fixed workload the jobs run between steps, whose time in a run
over its calibrated time says how much a shared machine's other jobs slowed that run's own work.
"""
import time

import numpy as np

from .microbench import _best, _xp


WAIT_S = 5e-4      # a pipeline stage's wait for its input, asleep in the poll, before it computes


def measure_overheads(repeats=5, clock=time.perf_counter):
    """Python's share of a step, measured on tiny arrays: one NumPy call; per parameter tensor, an Adam step
    and DDP's hook and write-back (on a one-rank ThreadWorld: what a machine without ``measure_in_a_job``'s
    figures is charged); one collective call that moves nothing; one traced span; one action of a pipeline
    (its runtime's bookkeeping and a backward call per micro-batch, beyond the layers' work). Per graph node
    and per parameter: ``measure_node_overheads``; DDP and FSDP in a real job: ``measure_in_a_job``."""
    xp, sync = _xp()
    from .. import Tensor, nn, optim, trace
    from ..comm import ThreadWorld, ring_all_reduce
    a, b = xp.ones(4, np.float32), xp.ones(4, np.float32)

    def calls():
        for _ in range(1000):
            a.__iadd__(b)
    numpy_call = _best(calls, repeats, sync, clock) / 1000
    k = 64
    params = [nn.Parameter(xp.ones(1, np.float32)) for _ in range(k)]
    for q in params:
        q.grad = xp.ones(1, np.float32)
    adam = optim.Adam(params, lr=1e-3)
    optimizer_param = _best(adam.step, repeats, sync, clock) / k

    def ddp_and_collective(comm):
        from ..parallel import DistributedDataParallel
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(k // 2)])
        x = Tensor(xp.ones((1, 1), np.float32))
        plain = _best(lambda: model(x).sum().backward(), repeats, sync, clock)
        ddp = DistributedDataParallel(model, comm)
        wrapped = _best(lambda: ddp(x).sum().backward(), repeats, sync, clock)
        one = xp.ones(1, np.float32)
        call = _best(lambda: [ring_all_reduce(comm, one) for _ in range(100)], repeats, sync, clock) / 100
        from ..nn import functional as F
        from ..parallel.pipeline import PipelineParallel
        m, tiny = 8, nn.Sequential(nn.Linear(1, 1))        # a pipeline of one stage: its actions' own cost
        pipe = PipelineParallel(tiny, comm, "1f1b", num_microbatches=m)
        xs, ys = xp.ones((m, 1), np.float32), xp.zeros(m, np.int64)
        loss = (lambda out, y: F.mse_loss(out, out * 0.0))  # noqa: E731
        piped = _best(lambda: pipe.train_step(xs, ys, loss), repeats, sync, clock)

        def direct():                                     # the same micro-batches without the runtime
            for i in range(m):
                out = tiny(Tensor(xs[i:i + 1]))
                (loss(out, ys[i:i + 1]) * (1.0 / m)).backward()
        action = max(0.0, piped - _best(direct, repeats, sync, clock)) / (2 * m)
        return max(0.0, wrapped - plain) / k, call, action     # (a real job's action: _pipeline_action)
    ddp_param, collective_call, pipeline_action = ThreadWorld(1).run(ddp_and_collective)[0]
    trace.enable(rank=0)

    def spans():
        for _ in range(200):
            with trace.span("x"):
                pass
    span = _best(spans, repeats, sync, clock) / 200
    trace.disable()
    trace.tracer().events.clear()
    return {"numpy_call_s": numpy_call, "optimizer_param_s": optimizer_param, "ddp_param_s": ddp_param,
            "collective_call_s": collective_call, "trace_span_s": span,
            "pipeline_action_s": pipeline_action}


def measure_node_overheads(machine, repeats=30, clock=time.perf_counter):
    """The Python of a graph node (the engine's, the ledger's, the module and tensor calls around it) and of a
    parameter given its first gradient of a step, as the library's own models run them: a tiny GPT (2 layers,
    width 8, 4 tokens) and a tiny MLP (4, 4, 4, 4; 1 row) each take forward, zero_grad and backward steps
    whose arithmetic is negligible; what plan/work.py counts for them, at ``machine``'s matmul and op costs
    (measured first), is subtracted, and the rest solved for: per node and per parameter (two models, two
    unknowns). Measured here, ~20 us per node: 3x a bare chain of nodes, which leaves out the model code."""
    from .. import nn, random
    from ..autograd import Tensor
    from .layout import GPT, MLP, Layout
    from .costs import Costs
    from .work import gpt_block_work, gpt_ends_work, mlp_layer_work
    xp, sync = _xp()
    costs = Costs({**machine, "autograd_node_s": 0.0, "leaf_grad_s": 0.0}, "fp32", 1, 1.0, fresh=False)
    with random.use_generator(random.fork()):
        gpt = nn.GPT(nn.GPTConfig(vocab_size=8, block_size=4, n_layer=2, n_head=2, n_embd=8))
        mlp = nn.MLP([4, 4, 4, 4])
    tokens, x, y = xp.zeros((1, 4), np.int64), Tensor(xp.ones((1, 4), np.float32)), xp.zeros(1, np.int64)

    def gpt_step():
        loss = gpt(tokens, tokens)[1]
        gpt.zero_grad()
        loss.backward()

    def mlp_step():
        loss = nn.functional.cross_entropy(mlp(x), y)
        mlp.zero_grad()
        loss.backward()
    one = Layout(batch_size=1)
    block, (emb, head) = gpt_block_work(GPT(8, 4, 2, 2, 8), one, 1), gpt_ends_work(GPT(8, 4, 2, 2, 8), one, 1)
    rows = []
    for step, works in ((gpt_step, [emb, block, block, head]), (mlp_step, mlp_layer_work(MLP((4, 4, 4, 4)), one, 1))):
        measured = _best(step, repeats, sync, clock)
        counted = sum(costs.seconds(w) for pair in works for w in pair)
        rows.append((sum(f.nodes + b.nodes for f, b in works), sum(f.leaves + b.leaves for f, b in works),
                     measured - counted))
    (n1, l1, r1), (n2, l2, r2) = rows
    node, leaf = np.linalg.solve(np.array([[n1, l1], [n2, l2]], np.float64), np.array([r1, r2]))
    if node <= 0 or leaf < 0:                  # a disturbed measurement: all of it per node
        node, leaf = max(r1, 0.0) / n1, 0.0
    return {"autograd_node_s": float(node), "leaf_grad_s": float(leaf)}


def measure_in_a_job(comm, repeats=30):
    """Under mpiexec -n 2: what DDP, FSDP and a pipeline's runtime add to the CPU time a step's own thread spends
    outside its waits (busy), beyond the plain model's: per step and per byte of gradient for DDP, per unit for
    FSDP, per action and per byte of the activation it sends or receives for a pipeline, and what one of its
    stage-to-stage messages takes (fixed and per byte: _pipeline_action, 2-128 KiB). Measured in a real
    job, where DDP's and FSDP's collectives run on the progress thread beside the step's own thread and a
    pipeline's messages go through MPI: on this 2-core machine DDP added 0.15-0.24 ms a step, FSDP 0.3-0.4 ms
    a unit and a pipeline 90-130 us an action, several times what a one-rank ThreadWorld, whose collectives
    move nothing, shows."""
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
    action, message = _line([(n, a) for n, a, _ in piped]), _line([(n, m) for n, _, m in piped])
    mine = np.array([max(0.0, t0 - per_byte * b0), per_byte, max(0.0, sharded - plain) / units, *action, *message])
    from .. import comm as mtcomm
    slowest = mtcomm.all_reduce(comm, mine, op="max")
    return {"ddp_step_s": float(slowest[0]), "ddp_byte_s": float(slowest[1]), "fsdp_unit_s": float(slowest[2]),
            "pipeline_action_s": float(slowest[3]), "pipeline_action_byte_s": float(slowest[4]),
            "pipeline_message_s": float(slowest[5]), "pipeline_message_byte_s": float(slowest[6]),
            "typical_job": typical_over_best(comm, 100), "typical_job_waited": typical_over_best(comm, 100, WAIT_S)}


def _line(points):
    """(a, b) >= 0 of t = a + b·n over [(n, t)], least squares in relative error (as calibrate's alpha-beta
    fits: a small message counts as much as a large one); points at t = 0 (nothing measured) left out."""
    points = [(n, t) for n, t in points if t > 0]
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    n, t = np.array(points, np.float64).T
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, n / t], axis=1), np.ones_like(t), rcond=None)
    if b < 0:
        return float(np.median(t)), 0.0
    if a < 0:
        return 0.0, float(np.median(t / n))
    return float(a), float(b)


def _best_busy(fn, repeats):
    """The least busy CPU (this thread's CPU time outside its waits for peers) of ``repeats`` calls of
    ``fn``, after one call to warm it up."""
    from ..comm.communicator import waiting_cpu_seconds
    return _best(fn, repeats, lambda: None, lambda: time.thread_time() - waiting_cpu_seconds())


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
    piped = _best_busy(lambda: pipe.train_step(x, y, nn.functional.cross_entropy), repeats)
    from ..parallel.pipeline.measure import summarize
    message = summarize(pipe)["message_cost_s"]            # the same on both ranks (a collective)
    alone = _best_busy(direct, repeats)
    trace.disable()
    trace.tracer().events.clear()
    return max(0.0, piped - alone) / (2 * m), message


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

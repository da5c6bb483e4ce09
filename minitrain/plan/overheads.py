"""The Python a step pays beyond its arithmetic, measured on one thread as the library's own code runs (plan
calibrate stores it; time.py charges it): per NumPy call, Adam step, DDP hook, collective call, traced span
and pipeline action (a one-rank ThreadWorld); per graph node and per parameter given its first gradient (a
tiny GPT and a tiny MLP, their ops' costs subtracted). In a real 2-rank job: plan/job_overheads.py; the
anchor: plan/anchor.py.
"""
import time

import numpy as np

from .microbench import _best, _xp


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
    from .layout import Layout
    from .models import GPT, MLP
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


def measure_ring_pair(machine, repeats=30, clock=time.thread_time):
    """The Python and small-array NumPy calls of one chunk pair of ring attention (parallel/context_parallel/
    ring.py), beyond the arithmetic plan/context.ring_attention_work prices at ``machine``'s costs: its
    forward and backward on one rank (zig-zag: 3 pairs each way, nothing to pass on), at the GPT job's sizes
    (16 rows x 4 heads, 16 positions, head width 16). Measured here, ~50 us a pair: a dozen NumPy calls on
    strided chunk views of 4,096-entry blocks, each several times the calibrated bare call."""
    from ..autograd import Tensor
    from ..comm import ThreadWorld
    from ..parallel.context_parallel import ring_attention
    from .costs import Costs
    from .context import ring_attention_work
    heads, s, d = 64, 16, 16
    fwd, bwd = ring_attention_work(heads, s, d, 1)
    counted = Costs({**machine, "ring_pair_s": 0.0}, "fp32", 1, 1.0, fresh=False)
    priced = counted.seconds(fwd) + counted.seconds(bwd)
    rng = np.random.default_rng(0)
    q, k, v, grad = (rng.standard_normal((16, 4, s, d)).astype(np.float32) for _ in range(4))

    def run(comm):
        def step():
            leaves = [Tensor(a, requires_grad=True) for a in (q, k, v)]
            ring_attention(*leaves, comm, layout="zigzag").backward(grad)
        return _best(step, repeats, lambda: None, clock)
    measured = ThreadWorld(1).run(run)[0]
    return {"ring_pair_s": max(0.0, measured - priced) / (fwd.ring_pairs + bwd.ring_pairs)}

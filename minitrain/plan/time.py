"""Step time: FLOPs at the calibrated matmul rate, elementwise passes at the calibrated bandwidth,
Python overhead per autograd node and NumPy call, alpha-beta communication, and the pipeline schedule's
own simulator (parallel.pipeline.simulate) for the bubble.

Per micro-batch and stage, forward F and backward B = compute + communication (tensor-parallel
collectives: 2 all-reduces of b·s·h per layer each way, or their RS/AG pairs with SP; point-to-point
activations between stages). simulate(schedule, F, B) on the slowest stage's costs gives the
pipeline's span; bubble = span - the stage's own work. Then the step's tail: data-parallel gradient
reduction (DDP overlaps its buckets with backward), the optimizer (~13 passes over Ψ for Adam).
Collective cost: t = steps·alpha + bytes·beta (ring all-reduce: 2(p-1) steps, 2(p-1)/p·N bytes;
RS / AG: half of that; p2p: 1 step, N bytes), alpha and beta calibrated per algorithm and p.
FLOPs per iteration (Narayanan et al. 2021, with recomputation): 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h)).
"""
import inspect
import math
from dataclasses import replace
from functools import lru_cache

import numpy as np

from ..parallel.pipeline import get_schedule, simulate
from .layout import PRECISIONS
from .memory import stage_bounds

DTYPE_NAMES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class Work:
    """What part of a step does on one rank: matmuls, elementwise elements by kind (simple arithmetic,
    transcendental, reduction along an axis, scatter-add), autograd nodes and other NumPy calls."""

    def __init__(self):
        self.mm, self.ew, self.nodes, self.calls, self.fresh = [], {}, 0, 0, 0.0   # fresh: bytes of new memory
        self.params = self.hooks = self.spans = self.actions = 0.0   # Python per parameter / span / pipeline action

    def matmul(self, m, k, n, batch=1, times=1):
        self.mm += [(m, k, n, batch)] * times
        return self

    def elementwise(self, kind, elements, count=1, dtype=None, calls=True):
        self.ew[kind, dtype] = self.ew.get((kind, dtype), 0) + elements * count
        self.calls += count if calls else 0
        return self

    def add(self, other, times=1):
        self.mm += other.mm * times
        for key, n in other.ew.items():
            self.ew[key] = self.ew.get(key, 0) + n * times
        self.nodes += other.nodes * times
        self.calls += other.calls * times
        self.fresh += other.fresh * times
        self.params += other.params * times
        self.hooks += other.hooks * times
        self.spans += other.spans * times
        self.actions += other.actions * times
        return self


class Costs:
    """Seconds of Work on one rank of ``machine`` with ``threads`` BLAS threads; ``slowdown`` > 1 when
    ranks outnumber cores (they take turns)."""

    def __init__(self, machine, precision, threads=1, slowdown=1.0):
        self.m, self.slowdown = machine, slowdown
        self.dtype = DTYPE_NAMES[precision]
        self.e = PRECISIONS[precision]
        table = machine["matmul_flops"][self.dtype]
        key = str(threads) if str(threads) in table else max(table, key=int)
        self.curve, self.threads = sorted(table[key]), key
        self.call, self.node_s = machine["numpy_call_s"], machine["autograd_node_s"]

    def rate(self, m, k, n):
        """FLOP/s of an m x k @ k x n product: the calibrated square curve at size (m·k·n)^(1/3)."""
        q = (m * k * n) ** (1 / 3)
        pts = self.curve
        if q <= pts[0][0]:
            return pts[0][1] * q / pts[0][0]                   # below the table: overhead-bound, linear
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if q <= n1:
                w = math.log(q / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
        return pts[-1][1]

    def seconds(self, work):
        t = sum(batch * 2 * m * k * n / self.rate(m, k, n) for m, k, n, batch in work.mm)
        per = self.m["elementwise_s_per_element"]
        t += sum(n * per[DTYPE_NAMES.get(dtype, self.dtype) if dtype else self.dtype][kind]
                 for (kind, dtype), n in work.ew.items())
        t += work.nodes * self.node_s + (work.calls + len(work.mm)) * self.call
        t += work.fresh * self.m.get("fresh_memory_s_per_byte", 0.0)
        t += (work.params * self.m.get("optimizer_param_s", 0.0) + work.hooks * self.m.get("ddp_param_s", 0.0)
              + work.spans * self.m.get("trace_span_s", 0.0) + work.actions * self.m.get("pipeline_action_s", 0.0))
        return self.slowdown * t


def collective(machine, name, nbytes, p, node_span=None):
    """Seconds of one collective over p ranks (calibrated alpha/beta of that algorithm at the nearest
    measured p; else the machine's link constants with the ring's step and byte counts). Over one rank
    it moves nothing but still costs a call."""
    if p <= 1:
        return machine.get("collective_call_s", 0.0)
    steps, sent = {"p2p": (1, nbytes), "ring_all_reduce": (2 * (p - 1), 2 * (p - 1) / p * nbytes),
                   "ring_reduce_scatter": (p - 1, (p - 1) / p * nbytes),
                   "ring_all_gather": (p - 1, (p - 1) / p * nbytes)}[name]
    table = machine.get("collectives", {}).get(name)
    if table:
        fit = table[min(table, key=lambda k: (abs(int(k) - p), -int(k)))]
        return steps * fit["alpha_s"] + sent * fit["beta_s_per_byte"]
    links = machine["links"]
    link = links["intra_node"] if node_span is not None and node_span <= machine.get("gpus_per_node", 1) \
        else links["inter_node"]
    return steps * link["alpha_s"] + sent / link["bytes_per_s"]


# ---------------------------------------------------------------- the work of one micro-batch
def mlp_layer_work(model, layout, rows):
    """Per module of the MLP: (forward, backward) Work for ``rows`` rows (the loss on the last)."""
    from .activations import mlp_pieces
    kept = mlp_pieces(model, replace(layout, recompute="none", offload_activations=False), rows)
    out = []
    for j, (kind, i, o) in enumerate(model.modules()):
        if kind == "linear":                    # x W^T + b; backward: W's gradient, x's (not for the input), b's
            fwd = Work().matmul(rows, i, o).elementwise("simple", rows * o)
            bwd = Work().matmul(o, rows, i, times=2 if j else 1).elementwise("reduce", rows * o)
        else:                                   # max(x, 0); backward: g * (out > 0)
            fwd, bwd = Work().elementwise("simple", rows * o), Work().elementwise("simple", rows * o, 2)
        fwd.nodes += 1
        fwd.fresh = kept[j].kept                # new memory: what forward keeps for backward
        out.append((fwd, bwd))
    rc, loss = rows * model.sizes[-1], "fp32" if layout.mixed else None
    out[-1][0].elementwise("simple", rc, 3, loss).elementwise("reduce", rc, 2, loss).elementwise("transcendental", rc, 2, loss)
    out[-1][1].elementwise("simple", rc, 2, loss).elementwise("transcendental", rc, 1, loss)
    out[-1][0].nodes += 1 + (2 if layout.mixed else 0)             # cross-entropy, casts
    return out


def gpt_block_work(model, layout, rows):
    """One transformer block, one micro-batch: (forward, backward) Work. E = b·s·h values (E/t in the
    tensor-parallel regions, E/t everywhere with SP), S = b·(a/t)·s² attention scores."""
    s, h, a, t = model.block_size, model.n_embd, model.n_head, layout.tp
    N, at, d = rows * s, a // t, h // a
    r = t if layout.sequence_parallel else 1
    E, Er, Et, S = N * h, N * h / r, N * h / t, rows * at * s * s
    drop = 1 if model.dropout else 0
    fwd = (Work().matmul(N, h, 3 * h // t).matmul(s, d, s, rows * at).matmul(s, s, d, rows * at)
           .matmul(N, h // t, h).matmul(N, h, 4 * h // t).matmul(N, 4 * h // t, h))
    fwd.elementwise("simple", Er, 10).elementwise("reduce", Er, 4)                 # two LayerNorms
    fwd.elementwise("simple", Et, 7).elementwise("simple", Er, 2)                  # biases
    fwd.elementwise("simple", S, 3).elementwise("reduce", S, 3).elementwise("transcendental", S)   # scale, mask, softmax
    fwd.elementwise("reduce", Et).elementwise("simple", Er, 2)                     # heads re-laid, residuals
    fwd.elementwise("simple", 4 * Et, 8).elementwise("transcendental", 4 * Et)     # GELU
    if drop:                                                                        # masks drawn, applied
        fwd.elementwise("transcendental", S + 2 * E, 1).elementwise("simple", S + 2 * Er, 2)
    fwd.nodes = 26 + 3 * drop
    from .activations import gpt_block_bytes
    fwd.fresh = gpt_block_bytes(model, replace(layout, recompute="none"), rows)[0]
    bwd = Work()
    for m_, k_, n_ in ((N, h, 3 * h // t), (N, h // t, h), (N, h, 4 * h // t), (N, 4 * h // t, h)):
        bwd.matmul(m_, n_, k_, times=2)
    bwd.matmul(s, s, d, rows * at, times=2).matmul(s, d, s, rows * at, times=2)
    bwd.elementwise("reduce", Et, 7).elementwise("reduce", Er, 2)                  # bias gradients
    bwd.elementwise("simple", Er, 14).elementwise("reduce", Er, 8)                 # LayerNorms
    bwd.elementwise("simple", Er, 2)                                                # residual gradients meet
    bwd.elementwise("simple", 4 * Et, 12)                                           # GELU
    bwd.elementwise("simple", S, 4 + drop).elementwise("reduce", S, 2)             # softmax, mask, scale
    bwd.elementwise("simple", 3 * Et, 6)                                            # q, k, v slices put back
    if layout.recompute == "full":
        bwd.add(fwd)
    elif layout.recompute == "selective":
        bwd.matmul(s, d, s, rows * at).matmul(s, s, d, rows * at)
        bwd.elementwise("simple", S, 3).elementwise("reduce", S, 3).elementwise("transcendental", S)
        bwd.nodes += 6
    return fwd, bwd


def gpt_ends_work(model, layout, rows):
    """(embedding forward, backward), (head + loss forward, backward) Work for one micro-batch."""
    s, h, t = model.block_size, model.n_embd, layout.tp
    N, r, v = rows * s, (t if layout.sequence_parallel else 1), -(-model.vocab_size // t)
    emb_f = Work().elementwise("simple", N * h, 3)                                  # two lookups, their sum
    emb_f.nodes = 3 + (2 if t > 1 else 0)
    emb_b = Work().elementwise("scatter", N * h).elementwise("reduce", N * h)       # rows added back (np.add.at)
    head_f = Work().matmul(N, h, v).elementwise("simple", N * h / r, 5).elementwise("reduce", N * h / r, 2)
    head_f.elementwise("simple", N * v, 4, "fp32").elementwise("reduce", N * v, 2, "fp32")
    head_f.elementwise("transcendental", N * v, 1, "fp32")
    head_f.nodes = 4
    head_b = Work().matmul(N, v, h, times=2).elementwise("simple", N * h / r, 7).elementwise("reduce", N * h / r, 4)
    head_b.elementwise("simple", N * v, 3, "fp32").elementwise("transcendental", N * v, 1, "fp32")
    return (emb_f, emb_b), (head_f, head_b)


def gpt_layer_costs(model, layout, rows, c, machine):
    """[embedding, blocks..., head]: (forward compute, forward comm, backward compute, backward comm)
    seconds. Tensor parallelism: g all-reduces b·s·h twice per block forward, f twice backward (SP: a
    reduce-scatter and an all-gather instead of each); vocab-parallel loss: three all-reduces of b·s."""
    key = (model, rows, layout.tp, layout.sequence_parallel, layout.recompute, layout.precision, id(machine),
           c.slowdown, c.threads, bool(layout.extras.get("parallel_job")) or layout.world > 1)
    if key not in _LAYER_COSTS:
        _LAYER_COSTS[key] = _gpt_layer_costs(model, layout, rows, c, machine)
        if len(_LAYER_COSTS) > 4096:
            _LAYER_COSTS.pop(next(iter(_LAYER_COSTS)))
    return _LAYER_COSTS[key]


_LAYER_COSTS = {}


def _gpt_layer_costs(model, layout, rows, c, machine):
    s, h, t = model.block_size, model.n_embd, layout.tp
    act = rows * s * h * c.e
    sp = layout.sequence_parallel
    pair = (collective(machine, "ring_reduce_scatter", act, t, t) + collective(machine, "ring_all_gather", act, t, t)
            if sp else collective(machine, "ring_all_reduce", act, t, t))
    if t == 1 and layout.world == 1 and not layout.extras.get("parallel_job"):   # nn.GPT in one process: no f, g
        pair = 0.0
    block_f, block_b = gpt_block_work(model, layout, rows)
    comm_b = 2 * pair * (2 if layout.recompute == "full" else 1)         # full recompute redoes the forward's
    (emb_f, emb_b), (head_f, head_b) = gpt_ends_work(model, layout, rows)
    loss_comm = 3 * collective(machine, "ring_all_reduce", rows * s * 8, t, t) if pair or t > 1 else 0.0
    return ([(c.seconds(emb_f), pair / (2 if sp else 1), c.seconds(emb_b), 0.0)]
            + [(c.seconds(block_f), 2 * pair, c.seconds(block_b), comm_b)] * model.n_layer
            + [(c.seconds(head_f), loss_comm, c.seconds(head_b), pair / (2 if sp else 1))])


def optimizer_work(n_params, n_tensors, layout):
    """Adam(W): 7 in-place updates and 6 new arrays per parameter tensor (+1 for AdamW's decay); SGD: 5;
    mixed precision / offload add the inf check, the fp32 gradient copy, the unscale and the copy back."""
    state = "fp32" if layout.mixed else None
    inplace, new = {"sgd": (3, 2), "adam": (7, 6), "adamw": (8, 6)}[layout.optimizer]
    w = Work().elementwise("inplace", n_params, inplace, state, calls=False)
    w.elementwise("simple", n_params, new, state, calls=False)
    if layout.mixed or layout.offload:
        w.elementwise("simple", n_params, 5, calls=False)
    w.params = n_tensors * (inplace + new) / 13 * (1.4 if layout.mixed or layout.offload else 1.0)
    return w                                       # (per tensor: the Python of an Adam step, calibrated)


# ---------------------------------------------------------------- the step
def _bubble(name, p, m, v, f, b):
    """(span, idle seconds per stage) of the schedule with forward f and backward b per chunk, from the
    schedule's own simulator (at backward/forward ratios 1.5^k, interpolated). Beyond m = 2p micro-batches
    the idle time is taken as constant: once every stage reaches its steady state it stops growing
    (exact for GPipe, 1F1B and interleaving; tests/test_plan.py checks it against full simulations)."""
    probe = m if m <= 2 * p else 2 * p
    if name == "interleaved_1f1b" and probe % p:
        probe = m
    step = math.log(b / f, 1.5) if f > 0 and b > 0 else 0.0    # simulated at ratios 1.5^k, interpolated
    lo = math.floor(step)
    idle_unit = _idle(name, p, probe, v, lo) + (step - lo) * (_idle(name, p, probe, v, lo + 1) - _idle(name, p, probe, v, lo))
    return m * v * (f + b) + idle_unit * (f + b), idle_unit * (f + b)


@lru_cache(maxsize=4096)
def _idle(name, p, m, v, k):
    """Idle time per stage, in units of (f + b), when backward costs 1.5^k times the forward."""
    ratio = 1.5 ** k
    f, b = 1 / (1 + ratio), ratio / (1 + ratio)
    kwargs = {"forward_cost": f, "backward_cost": b}
    if "weight_cost" in inspect.signature(simulate).parameters:   # zero-bubble schedules split B and W
        kwargs = {"forward_cost": f, "backward_cost": b / 2, "weight_cost": b / 2}
    sim = simulate(get_schedule(name, p, m, chunks=v), **kwargs)
    return sim["total_time"] - m * v * (f + b)


def predict_time(model, layout, machine):
    """{'compute', 'comm', 'bubble', 'total'} seconds per step and 'bubble_fraction', for the slowest
    stage. On a CPU a job of N ranks gives each cores/N BLAS threads, and N > cores ranks take turns."""
    if model.kind == "params":
        return {"compute": 0.0, "comm": 0.0, "bubble": 0.0, "total": 0.0, "bubble_fraction": 0.0}
    cpu = machine.get("device", "cpu") == "cpu"
    cores = machine.get("cores") or 1
    threads = max(1, cores // layout.world) if cpu else 1
    c = Costs(machine, layout.precision, threads, max(1.0, layout.world / cores) if cpu else 1.0)
    rows, e = layout.micro_batch_size, PRECISIONS[layout.precision]
    if model.kind == "mlp":
        layers = [(c.seconds(f), 0.0, c.seconds(b), 0.0) for f, b in mlp_layer_work(model, layout, rows)]
        if layout.recompute == "full":                      # every segment but the last runs forward twice
            layers = [(f, 0.0, b + f, 0.0) for f, _, b, _ in layers]
        sizes = [[i * o, o] if k == "linear" else [] for k, i, o in model.modules()]
        act = rows * max(model.sizes[1:-1] or [model.sizes[0]]) * e
    else:
        layers = gpt_layer_costs(model, layout, rows, c, machine)
        h, t, v = model.n_embd, layout.tp, -(-model.vocab_size // layout.tp)
        block = [2 * h, 3 * h * h // t + 3 * h // t, h * h // t + h, 2 * h, 4 * h * h // t + 4 * h // t, 4 * h * h // t + h]
        sizes = [[v * h, model.block_size * h]] + [block] * model.n_layer + [[2 * h, v * h]]
        act = rows * model.block_size * h * e
    p, v, m = layout.pp, layout.chunks, layout.microbatches
    counts, prefix = _prefix(tuple(layers), tuple(tuple(x) for x in sizes))
    bounds, where = stage_bounds(counts, layout.schedule, p, v)          # as the runtime cuts and places them
    bounds, owner = np.array(bounds), np.array([rank for rank, _ in where])
    p2p = (collective(machine, "p2p", act, 2, 2 * layout.tp * layout.dp) + collective(machine, "p2p", 80, 2)
           if p > 1 else 0.0)                                # a header, then the activation (or its gradient)
    # per stage and micro-batch, its chunks together: (forward, its comm, backward, its comm, params, tensors)
    work = np.zeros((p, 6))
    np.add.at(work, owner, prefix[bounds[1:]] - prefix[bounds[:-1]])
    fc, fm, bc, bm, n_local, n_tensors = work[int(np.argmax(work[:, :4].sum(axis=1)))].tolist()
    fm, bm, n_local, n_tensors = fm + v * p2p, bm + v * p2p, int(n_local), int(n_tensors)
    if p > 1:                                                # the schedule's own simulator, per chunk
        span, idle = _bubble(layout.schedule, p, m, v, (fc + fm) / v, (bc + bm) / v)
    else:
        span, idle = m * (fc + fm + bc + bm), 0.0
    compute, comm = m * (fc + bc), m * (fm + bm)
    # the step's tail: gradients reduced over dp (DDP overlaps its buckets with backward), the optimizer
    dp, z, grad_bytes, span_dp = layout.dp, layout.zero, n_local * e, layout.tp * layout.dp
    tail = Work()
    if model.kind == "mlp" and p == 1:                       # the job's loop: step/forward/backward/optimizer spans
        tail.spans += 5
    if model.kind == "mlp" and p == 1 and z == 0 and not layout.local_sgd_every:
        reduce = collective(machine, "ring_all_reduce", grad_bytes, dp, span_dp)
        cap = layout.bucket_cap_mb * 2 ** 20
        hidden = min(reduce * (1 - cap / grad_bytes), m * bc) if dp > 1 and cap < grad_bytes else 0.0
        comm += reduce - hidden
        tail.elementwise("simple", n_local, 2, calls=False)   # into the buckets and back out
        tail.hooks += n_tensors
    elif layout.local_sgd_every:
        comm += collective(machine, "ring_all_reduce", grad_bytes, dp, span_dp) / layout.local_sgd_every
    elif z in (1, 2):
        comm += (collective(machine, "ring_reduce_scatter", grad_bytes, dp, span_dp)
                 + collective(machine, "ring_all_gather", grad_bytes, dp, span_dp))
        tail.elementwise("simple", n_local, 3, calls=False)
        tail.hooks += n_tensors
    elif z == 3:                                             # per unit: gathered twice, gradients scattered
        units = [n for n in counts if n]
        for n in units:
            size = -(-n // dp) * dp * e
            comm += 2 * collective(machine, "ring_all_gather", size, dp, span_dp) + \
                collective(machine, "ring_reduce_scatter", size, dp, span_dp)
        tail.elementwise("simple", n_local, 4, calls=False)
        tail.hooks += n_tensors + 4 * len(units)
    elif dp > 1 or layout.extras.get("parallel_job"):        # the pipeline's one flat all-reduce over dp
        comm += collective(machine, "ring_all_reduce", grad_bytes, dp, span_dp) if dp > 1 else 0.0
        tail.elementwise("simple", n_local, 3 if dp > 1 else 0, calls=False)
        tail.calls += 2 * n_tensors if dp > 1 else 0
    if p > 1 or layout.extras.get("parallel_job"):           # the pipeline runtime's own work per action
        tail.actions += 2 * m * v
    state_n = n_local if z == 0 else -(-n_local // dp)
    tail.add(optimizer_work(state_n, n_tensors if z == 0 else 1, layout))
    if model.kind == "gpt":                                   # clip_grad_norm_: squares in fp64, scaled
        tail.elementwise("simple", n_local, 3, "fp64", calls=False).elementwise("reduce", n_local, 1, "fp64", calls=False)
        tail.elementwise("simple", n_local, 2, calls=False)
        tail.calls += 6 * n_tensors
        if layout.extras.get("parallel_job"):                 # clip over tp and pp, the loss's mean over dp
            comm += collective(machine, "ring_all_reduce", 8, layout.tp, layout.tp)
            comm += collective(machine, "ring_all_reduce", 8, p, p * span_dp)
            comm += collective(machine, "ring_all_reduce", 8, dp, span_dp) if dp > 1 else 0.0
    compute += c.seconds(tail)
    total = compute + comm + idle
    return {"compute": compute, "comm": comm, "bubble": idle, "total": total,
            "bubble_fraction": idle / span if p > 1 and span else 0.0}


@lru_cache(maxsize=1024)
def _prefix(layers, sizes):
    """Parameter counts per layer, and running sums of (forward, its comm, backward, its comm, parameters,
    tensors) over the layers: a virtual stage's totals are a difference of two."""
    counts = tuple(sum(x) for x in sizes)
    rows = np.array([(*layer, n, len(sz)) for layer, n, sz in zip(layers, counts, sizes)], np.float64)
    return counts, np.vstack([np.zeros((1, 6)), np.cumsum(rows, axis=0)])


def flops_per_iteration(model, layout):
    """Matmul FLOPs of one step of the whole model (all ranks): forward, backward (2x), and the forward
    again where it is recomputed. GPT with full recomputation: Narayanan et al.'s 96Bslh²(1 + s/6h + V/16lh)."""
    B = layout.batch_size
    if model.kind == "params":
        return 6 * B * model.num_params
    if model.kind == "mlp":
        fwd = sum(2 * B * i * o for i, o in model.linears())
        first = 2 * B * model.linears()[0][0] * model.linears()[0][1]       # no gradient for the input
        extra = fwd - 2 * B * model.sizes[-2] * model.sizes[-1] if layout.recompute == "full" else 0
        return 3 * fwd - first + extra
    s, h, L = model.block_size, model.n_embd, model.n_layer
    v_pad = -(-model.vocab_size // layout.tp) * layout.tp
    layer = 24 * B * s * h * h + 4 * B * s * s * h                          # one layer's forward
    recompute = {"full": layer, "selective": 4 * B * s * s * h}.get(layout.recompute, 0)
    return L * (3 * layer + recompute) + 6 * B * s * h * v_pad

"""Step time: the work a rank does (plan/work.py: matmuls, the library's ops, graph nodes, counted from
the code) in seconds on the machine (matmuls at the calibrated FLOP rate of their size, one product or a
batch of them; each op at its calibrated cost per call and per element, plan/ops.py; the engine's Python
per node and per parameter given a gradient), alpha-beta communication, and the pipeline schedule's own
simulator (parallel.pipeline.simulate) for the bubble.

Per micro-batch and stage, forward F and backward B = compute + communication (tensor-parallel
collectives: 2 all-reduces of b·s·h per layer each way, or their RS/AG pairs with SP; point-to-point
activations between stages). simulate(schedule, F, B) on the slowest stage's costs gives the
pipeline's span; bubble = span - the stage's own work. Then the step's tail: data-parallel gradient
reduction (DDP overlaps its buckets with backward), the optimizer.
Collective cost: t = steps·alpha + bytes·beta (ring all-reduce: 2(p-1) steps, 2(p-1)/p·N bytes;
RS / AG: half of that; p2p: 1 step, N bytes), alpha and beta calibrated per algorithm and p.
FLOPs per iteration (Narayanan et al. 2021, with recomputation): 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h)).
"""
import inspect
import math
from functools import lru_cache

import numpy as np

from ..backend import default_blas_threads
from ..parallel.pipeline import get_schedule, simulate
from .layout import PRECISIONS
from .memory import stage_bounds
from .ops import op_fit
from .work import (Work, gpt_block_work, runs_nn_gpt, gpt_ends_work, mlp_layer_work, mlp_recompute, optimizer_work,  # noqa: F401
                   recorded_nodes)

DTYPE_NAMES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class Costs:
    """Seconds of Work on one rank of ``machine`` with ``threads`` BLAS threads; ``slowdown`` > 1 when
    ranks outnumber cores (they take turns); ``fresh``: whether new memory costs page faults (no, below the
    size the jobs' held heap serves: backend.hold_host_memory)."""

    def __init__(self, machine, precision, threads=1, slowdown=1.0, fresh=True):
        self.m, self.slowdown, self.fresh = machine, slowdown, fresh
        self.dtype = DTYPE_NAMES[precision]
        self.e = PRECISIONS[precision]
        self.curve, self.threads = self._curve("matmul_flops", threads)
        self.batched = self._curve("matmul_batched_flops", threads)[0] or self.curve
        grids = machine.get("matmul_rows_flops", {}).get(self.dtype, {})
        self.grid = grids.get(self.threads) or (grids[max(grids, key=int)] if grids else None)
        self.call, self.node_s = machine["numpy_call_s"], machine["autograd_node_s"]
        self.leaf_s = machine.get("leaf_grad_s", 0.0)
        self.fits = _fits(id(machine), machine)          # (op, dtype) -> (per call, per element), memoized

    def _curve(self, key, threads):
        table = self.m.get(key, {}).get(self.dtype, {})
        if not table:
            return None, str(threads)
        th = str(threads) if str(threads) in table else max(table, key=int)
        return sorted(table[th]), th

    @staticmethod
    def rate(m, k, n, pts):
        """FLOP/s of an m x k @ k x n product on a calibrated curve ``pts`` of n x n x n products (square, or per
        product of a batch) at its size (m·k·n)^(1/3): the square of the same FLOPs. (A single product of a few
        rows by a wide weight runs well below it: ``single`` prices those on the rows x width grid.)"""
        q = (m * k * n) ** (1 / 3)
        if q <= pts[0][0]:
            return pts[0][1] * q / pts[0][0]                   # below the table: overhead-bound, linear
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if q <= n1:
                w = math.log(q / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
        return pts[-1][1]

    def single(self, m, k, n):
        """FLOP/s of one m x k @ k x n product: on the calibrated rows x width grid (log-log interpolation,
        width sqrt(k·n), clamped to the grid), else the square curve."""
        if self.grid is None:
            return self.rate(m, k, n, self.curve)
        rows, widths, table = self.grid["rows"], self.grid["width"], self.grid["flops"]

        def where(x, axis):
            x = min(max(x, axis[0]), axis[-1])
            i = max(0, min(len(axis) - 2, sum(1 for a in axis if a <= x) - 1))
            return i, math.log(x / axis[i]) / math.log(axis[i + 1] / axis[i])
        (i, u), (j, w) = where(m, rows), where(math.sqrt(k * n), widths)
        logs = [[math.log(table[i + a][j + b]) for b in (0, 1)] for a in (0, 1)]
        return math.exp((1 - u) * ((1 - w) * logs[0][0] + w * logs[0][1]) + u * ((1 - w) * logs[1][0] + w * logs[1][1]))

    def seconds(self, work):
        t = sum(2 * m * k * n / self.single(m, k, n) if batch == 1 else batch * 2 * m * k * n / self.rate(m, k, n, self.batched)
                for m, k, n, batch in work.mm)
        for (name, dtype), (n, calls) in work.ops.items():
            key = (name, DTYPE_NAMES.get(dtype, self.dtype) if dtype else self.dtype)
            fit = self.fits.get(key) or self.fits.setdefault(key, op_fit(self.m, *key))
            t += calls * fit[0] + n * fit[1]
        per = self.m["elementwise_s_per_element"]
        t += sum(n * per[DTYPE_NAMES.get(dtype, self.dtype) if dtype else self.dtype][kind]
                 for (kind, dtype), n in work.ew.items())
        t += (work.nodes + work.unrecorded) * self.node_s + work.leaves * self.leaf_s + work.calls * self.call
        t += len(work.mm) * self.call if self.grid is None else 0.0     # a datasheet's rates leave out the launch
        t += work.fresh * self.m.get("fresh_memory_s_per_byte", 0.0) if self.fresh else 0.0
        t += (work.hooks * self.m.get("ddp_param_s", 0.0) + work.units * self.m.get("fsdp_unit_s", 0.0)
              + work.spans * self.m.get("trace_span_s", 0.0)
              + work.actions * self.m.get("pipeline_action_s", 0.0))
        return self.slowdown * t


_FITS = {}


def _fits(key, machine):
    """The ops' costs of one machine, looked up once (a --search prices thousands of layouts)."""
    if key not in _FITS or _FITS[key][0] is not machine:
        _FITS[key] = (machine, {})
    return _FITS[key][1]


def collective(machine, name, nbytes, p, node_span=None, busy=False):
    """Seconds of one collective over p ranks (calibrated alpha/beta of that algorithm at the nearest
    measured p, its best case: the wait for a rank that arrives late is the compute's, priced at the slowest
    rank's median pace, typical(); else the machine's link constants with the ring's step and byte counts).
    Over one rank it moves nothing but still costs a call. ``busy``: only what the calling thread computes outside its
    waits (its copies, reductions and calls; calibrated alike; a datasheet machine: the call)."""
    call = machine.get("collective_call_s", 0.0)
    if p <= 1:
        return call
    steps, sent = {"p2p": (1, nbytes), "all_to_all": (p - 1, (p - 1) / p * nbytes),   # pairwise, p-1 rounds
                   "ring_all_reduce": (2 * (p - 1), 2 * (p - 1) / p * nbytes),
                   "ring_reduce_scatter": (p - 1, (p - 1) / p * nbytes),
                   "ring_all_gather": (p - 1, (p - 1) / p * nbytes)}[name]
    table = machine.get("collectives", {}).get(name)
    if name == "all_to_all" and not table:       # pairwise exchange: p-1 rounds of a send and a receive each
        table = machine.get("collectives", {}).get("p2p")
    if table:
        fit = table[min(table, key=lambda k: (abs(int(k) - p), -int(k)))]
        if busy:
            return steps * fit["busy_alpha_s"] + sent * fit["busy_beta_s_per_byte"] if "busy_alpha_s" in fit else call
        return steps * fit["alpha_s"] + sent * fit["beta_s_per_byte"]   # the ranks arriving apart: in typical()
    if busy:
        return call
    links = machine["links"]
    link = links["intra_node"] if node_span is not None and node_span <= machine.get("gpus_per_node", 1) \
        else links["inter_node"]
    return steps * link["alpha_s"] + sent / link["bytes_per_s"]


def gpt_layer_costs(model, layout, rows, c, machine):
    """[embedding, blocks..., head]: (forward compute, forward comm, backward compute, backward comm, and
    the two comms' busy parts) seconds. Tensor parallelism: g all-reduces b·s·h twice per block forward, f twice backward (SP: a
    reduce-scatter and an all-gather instead of each); vocab-parallel loss: three all-reduces of b·s."""
    key = (model, rows, layout.tp, layout.sequence_parallel, layout.recompute, layout.precision, id(machine),
           c.slowdown, c.threads, c.fresh, bool(layout.extras.get("parallel_job")) or layout.world > 1,
           layout.cp, layout.cp_method, layout.ep, layout.dp, bool(layout.extras.get("moe_dp_job")))
    if key not in _LAYER_COSTS:
        _LAYER_COSTS[key] = _gpt_layer_costs(model, layout, rows, c, machine)
        if len(_LAYER_COSTS) > 4096:
            _LAYER_COSTS.pop(next(iter(_LAYER_COSTS)))
    return _LAYER_COSTS[key]


_LAYER_COSTS = {}


def _gpt_layer_costs(model, layout, rows, c, machine):
    s, h, t = model.block_size // layout.cp, model.n_embd, layout.tp
    act = rows * s * h * c.e
    sp = layout.sequence_parallel
    single = runs_nn_gpt(layout)                                        # nn.GPT: no f, g

    def comm(busy):
        pair = (collective(machine, "ring_reduce_scatter", act, t, t, busy=busy)
                + collective(machine, "ring_all_gather", act, t, t, busy=busy)
                if sp else collective(machine, "ring_all_reduce", act, t, t, busy=busy))
        pair = 0.0 if single else pair
        loss = 3 * collective(machine, "ring_all_reduce", rows * s * 8, t, t, busy=busy) if not single else 0.0
        # embedding (g), block (2 g forward; 2 f backward, twice with full recompute), head (loss; f backward)
        return [(pair / (2 if sp else 1), 0.0), (2 * pair, 2 * pair * (2 if layout.recompute == "full" else 1)),
                (loss, pair / (2 if sp else 1))]
    device = machine.get("device", "cpu")
    block_f, block_b = gpt_block_work(model, layout, rows, device)
    (emb_f, emb_b), (head_f, head_b) = gpt_ends_work(model, layout, rows, device)
    wall, own = comm(False), comm(True)
    emb, block, head = [(c.seconds(f), wall[i][0], c.seconds(b), wall[i][1], own[i][0], own[i][1])
                        for i, (f, b) in enumerate(((emb_f, emb_b), (block_f, block_b), (head_f, head_b)))]
    wall_cp, own_cp = axes_comm(model, layout, rows, machine, False), axes_comm(model, layout, rows, machine, True)
    block = _plus(block, wall_cp[0], own_cp[0])
    moe = block
    if model.moe_experts:
        moe_f, moe_b = gpt_block_work(model, layout, rows, device, moe=True)
        moe = _plus((c.seconds(moe_f), block[1], c.seconds(moe_b), block[3], block[4], block[5]),
                    wall_cp[1], own_cp[1])
    return [emb] + [moe if model.is_moe_layer(i) else block for i in range(model.n_layer)] + [head]


def _plus(costs, wall, own):
    """A layer's costs with more communication (forward, backward) added, wall and busy."""
    f, fm, b, bm, fo, bo = costs
    return (f, fm + wall[0], b, bm + wall[1], fo + own[0], bo + own[1])


def axes_comm(model, layout, rows, machine, busy):
    """((forward, backward) seconds of context parallelism's communication in a block, (the same) in an MoE
    block with its four all-to-alls added (plan/experts.py). Ring: cp-1 hops of K and V forward, of K, V,
    dK and dV backward; Ulysses: four all-to-alls each way. The ep ranks are consecutive dp ranks."""
    from .experts import all_to_all_bytes, cp_block_bytes
    c, t, ep = layout.cp, layout.tp, layout.ep
    fwd = bwd = 0.0
    if c > 1:
        block = cp_block_bytes(model, layout, rows)
        if layout.cp_method == "ring":
            fwd = (c - 1) * collective(machine, "p2p", 2 * block, 2, c * t, busy=busy)
            bwd = (c - 1) * collective(machine, "p2p", 4 * block, 2, c * t, busy=busy)
        else:
            fwd = bwd = 4 * collective(machine, "all_to_all", block, c, c * t, busy=busy)
    a2a = 0.0
    if model.moe_experts and ep > 1:
        whole = all_to_all_bytes(model, layout, rows) * ep / (ep - 1)      # the rows' bytes, to and from all
        a2a = 2 * collective(machine, "all_to_all", whole, ep, ep * c * t, busy=busy)
    return (fwd, bwd), (fwd + a2a, bwd + a2a)


# ---------------------------------------------------------------- the step
def _bubble(name, p, m, v, f, b, message=0.0):
    """(span, idle seconds per stage) of the schedule with forward f and backward b per chunk, from the
    schedule's own simulator (at backward/forward ratios 1.5^k, interpolated). Beyond m = 2p micro-batches
    the idle time is taken as constant: once every stage reaches its steady state it stops growing
    (exact for GPipe, 1F1B and interleaving; tests/test_plan.py checks it against full simulations).
    (With a calibrated message cost: _simulated.)"""
    probe = m if m <= 2 * p else 2 * p
    if name == "interleaved_1f1b" and probe % p:
        probe = m
    step = math.log(b / f, 1.5) if f > 0 and b > 0 else 0.0    # simulated at ratios 1.5^k, interpolated
    lo = math.floor(step)
    idle_unit = _idle(name, p, probe, v, lo) + (step - lo) * (_idle(name, p, probe, v, lo + 1) - _idle(name, p, probe, v, lo))
    return m * v * (f + b) + idle_unit * (f + b), idle_unit * (f + b)


def _sig(values):
    """Seconds to three significant digits, as a tuple (a cache key for _simulated)."""
    return tuple(float(f"{x:.3g}") for x in values)


@lru_cache(maxsize=4096)
def _simulated(name, p, m, v, f, b, message):
    """The span of the schedule simulated at each virtual stage's forward f[k] and backward b[k] (seconds per
    micro-batch; zero-bubble schedules: b split evenly into B and W) and ``message``: the seconds from a
    stage's compute ending to the next stage having its output (calibrated as the runtime meets it,
    plan/overheads.py). A message comparable to an action puts the stages in lockstep (1F1B at p = 2: each
    backward waits for a round trip), so the idle time grows with m and no longer scales with f + b: no
    shortcut (_bubble's) holds, and a stage lighter than the slowest sends early enough to hide messages."""
    kwargs = {"forward_cost": f, "backward_cost": b}
    if "weight_cost" in inspect.signature(simulate).parameters:   # zero-bubble schedules split B and W
        kwargs = {"forward_cost": f, "backward_cost": tuple(x / 2 for x in b), "weight_cost": tuple(x / 2 for x in b)}
    return simulate(get_schedule(name, p, m, chunks=v), message_cost=message, **kwargs)["total_time"]


@lru_cache(maxsize=4096)
def _idle(name, p, m, v, k):
    """Idle time per stage, in units of (f + b), when backward costs 1.5^k times the forward. GPipe and
    1F1B (and interleaving when p divides m) idle p - 1 chunk-times at any ratio (Huang et al.; Narayanan et
    al.): the simulator gives exactly that (tests/test_plan.py), so --search does not run it for them."""
    if name in ("gpipe", "1f1b") or (name == "interleaved_1f1b" and m % p == 0):
        return float(p - 1)
    ratio = 1.5 ** k
    f, b = 1 / (1 + ratio), ratio / (1 + ratio)
    kwargs = {"forward_cost": f, "backward_cost": b}
    if "weight_cost" in inspect.signature(simulate).parameters:   # zero-bubble schedules split B and W
        kwargs = {"forward_cost": f, "backward_cost": b / 2, "weight_cost": b / 2}
    sim = simulate(get_schedule(name, p, m, chunks=v), **kwargs)
    return sim["total_time"] - m * v * (f + b)


def typical(machine, world, waited=False):
    """How much slower a job's median step does its CPU work than the calibrated constants, each a best case:
    the anchor's median as a job of ``world`` ranks meets it over its best (plan/overheads.typical_over_best:
    alone, or every rank of a 2-rank job at once; ``waited``: each run after a wait asleep, as a pipeline's
    stage computes once its input has come); 1 where not calibrated so. (A job's step timer runs the same
    anchor: a step in anchors times the calibrated anchor times this is a quiet median step.)"""
    key = "typical_alone" if world == 1 else "typical_job_waited" if waited else "typical_job"
    return max(1.0, machine.get(key, 1.0))


def predict_time(model, layout, machine):
    """{'compute', 'comm', 'bubble', 'total'} seconds per step and 'bubble_fraction', for the slowest
    stage; 'busy': the CPU time of the step's own thread (compute without taking turns, plus the busy part of
    the collectives it runs itself), which the jobs' step timer measures. On a CPU a job of N ranks gives each
    cores/N BLAS threads, and N > cores ranks take turns."""
    if model.kind == "params":
        return {"compute": 0.0, "comm": 0.0, "bubble": 0.0, "total": 0.0, "bubble_fraction": 0.0,
                "comm_busy": 0.0, "busy": 0.0}
    cpu = machine.get("device", "cpu") == "cpu"
    cores = machine.get("cores") or 1
    threads = (layout.threads or default_blas_threads(layout.world, cores)) if cpu else 1
    rows, e = layout.micro_batch_size, PRECISIONS[layout.precision]
    fresh = _largest_activation(model, layout) * e >= machine.get("held_array_bytes", 0)
    turns = max(1.0, layout.world / cores) if cpu else 1.0
    step = Costs(machine, layout.precision, threads, turns * typical(machine, layout.world), fresh)
    c = step if layout.pp == 1 else Costs(   # a pipeline's stage computes once its input has come, asleep till then
        machine, layout.precision, threads, turns * typical(machine, layout.world, True), fresh)
    if model.kind == "mlp":
        layers = [(c.seconds(f), 0.0, c.seconds(b), 0.0, 0.0, 0.0) for f, b in _mlp_works(model, layout, rows)]
        act = rows * max(model.sizes[1:-1] or [model.sizes[0]]) * e
    else:
        layers = gpt_layer_costs(model, layout, rows, c, machine)
        act = rows * model.block_size // layout.cp * model.n_embd * e
    sizes = _layer_sizes(model, layout)
    p, v, m = layout.pp, layout.chunks, layout.microbatches
    counts, prefix = _prefix(tuple(layers), tuple(tuple(x) for x in sizes), _expert_counts(model, layout))
    bounds, where = stage_bounds(counts, layout.schedule, p, v)          # as the runtime cuts and places them
    bounds, owner = np.array(bounds), np.array([rank for rank, _ in where])
    # per stage and micro-batch, its chunks together: (forward, its comm, backward, its comm, the comms' busy
    # parts, params, tensors, routed experts' params)
    work = np.zeros((p, 9))
    np.add.at(work, owner, prefix[bounds[1:]] - prefix[bounds[:-1]])
    fc, fm, bc, bm, fo, bo, n_local, n_tensors, n_experts = work[int(np.argmax(work[:, :4].sum(axis=1)))].tolist()
    n_local, n_tensors, n_experts = int(n_local), int(n_tensors), int(n_experts)
    if p > 1 and "pipeline_message_s" in machine:           # a message as the runtime meets it, between stages
        message = machine["pipeline_message_s"] + machine["pipeline_message_byte_s"] * act
        stages = prefix[bounds[1:]] - prefix[bounds[:-1]]    # each virtual stage at its own cost: a light
        span = _simulated(layout.schedule, p, m, v, _sig(stages[:, 0] + stages[:, 1]),  # stage's outputs come
                          _sig(stages[:, 2] + stages[:, 3]), _sig([message])[0])       # early to a heavy one
        idle = max(0.0, span - m * (fc + fm + bc + bm))
    elif p > 1:                                              # a header, then the activation (or its gradient)
        hop = v * (collective(machine, "p2p", act, 2, 2 * layout.tp * layout.dp) + collective(machine, "p2p", 80, 2))
        fm, bm = fm + hop, bm + hop                          # (their busy part: in the calibrated action's)
        span, idle = _bubble(layout.schedule, p, m, v, (fc + fm) / v, (bc + bm) / v)   # the schedule's simulator
    else:
        span, idle = m * (fc + fm + bc + bm), 0.0
    compute, comm, comm_busy = m * (fc + bc), m * (fm + bm), m * (fo + bo)

    def coll(name, nbytes, p, span=None, times=1.0, own_thread=True):
        """A collective of the tail: its wall time to comm; its busy part to comm_busy if this thread runs it."""
        nonlocal comm, comm_busy
        comm += times * collective(machine, name, nbytes, p, span)
        comm_busy += times * collective(machine, name, nbytes, p, span, busy=True) if own_thread else 0.0
    # the step's tail: gradients reduced over dp (DDP overlaps its buckets with backward), the optimizer
    dp, z, grad_bytes, span_dp = layout.dp, layout.zero, n_local * e, layout.tp * layout.dp
    tail = Work()
    if model.kind == "mlp" and p == 1:                       # the job's loop: step/forward/backward/optimizer spans
        tail.spans += 5
    if model.kind == "mlp" and p == 1 and z == 0 and not layout.local_sgd_every:
        reduce = collective(machine, "ring_all_reduce", grad_bytes, dp, span_dp)
        cap = layout.bucket_cap_mb * 2 ** 20
        hidden = min(reduce * (1 - cap / grad_bytes), m * bc) if dp > 1 and cap < grad_bytes else 0.0
        comm += reduce - hidden                              # (on the progress thread: nothing busy here)
        if "ddp_step_s" in machine:                          # DDP's own cost in a job, measured as a whole
            compute += step.slowdown * (machine["ddp_step_s"] + machine["ddp_byte_s"] * grad_bytes)
        else:                                                # its hooks; into the buckets and back out
            tail.op("copy", n_local, count=2, calls=2 * n_tensors).hooks += n_tensors
    elif layout.local_sgd_every:
        coll("ring_all_reduce", grad_bytes, dp, span_dp, 1 / layout.local_sgd_every)
    elif z in (1, 2) or (z == 3 and model.kind == "gpt"):     # (GPT3D: the stage gathered once a step)
        coll("ring_reduce_scatter", grad_bytes, dp, span_dp, own_thread=z == 1)
        coll("ring_all_gather", grad_bytes, dp, span_dp)
        shard = -(-n_local // dp)                            # ZeRO-1 zeroes the flat gradient, ZeRO-2 copies
        tail.op("zeros" if z == 1 else "copy", n_local, calls=1 if z == 1 else n_tensors)   # into its buckets
        tail.op("copy", shard).op("zeros", shard)            # the updated shard sent; the shard's gradient zeroed
        tail.hooks += n_tensors
    elif z == 3:                                             # per unit: gathered twice, gradients scattered
        units = [n for n in counts if n]                     # (asynchronous: on the progress thread)
        for n in units:
            size = -(-n // dp) * dp * e
            coll("ring_all_gather", size, dp, span_dp, 2, own_thread=False)
            coll("ring_reduce_scatter", size, dp, span_dp, own_thread=False)
        tail.op("copy", n_local, calls=n_tensors).op("zeros", -(-n_local // dp))   # gradients into the staging
        tail.hooks += n_tensors
        tail.units += len(units)
    elif dp * layout.cp > 1 or layout.extras.get("parallel_job"):   # one flat all-reduce over dp (x cp)
        # the routed experts' gradients over the dp/ep ranks holding the same experts, the rest over all
        cp, rest = layout.cp, dp // layout.ep * layout.cp
        coll("ring_all_reduce", grad_bytes - n_experts * e, dp * cp, span_dp * cp)
        if n_experts and rest > 1:
            coll("ring_all_reduce", n_experts * e, rest, span_dp * cp)
        tail.elementwise("simple", n_local, 3 if dp > 1 else 0, calls=False)
        tail.calls += 2 * n_tensors if dp > 1 else 0
    if p > 1 or layout.extras.get("parallel_job"):           # the pipeline runtime's own work per action
        tail.actions += 2 * m * v                            # (and per byte it sends or receives)
        compute += step.slowdown * 2 * m * v * machine.get("pipeline_action_byte_s", 0.0) * (act if p > 1 else 0)
    state_n = n_local if z == 0 else -(-n_local // dp)
    tail.add(optimizer_work(state_n, n_tensors if z == 0 else 1, layout))
    if m > 1:                                                 # later micro-batches add into the gradients
        tail.op("inplace_add", n_local * (m - 1), calls=n_tensors * (m - 1))
    if model.kind == "gpt":                                   # clip_grad_norm_: the norm, then (clipping) g *= c
        tail.op("clip", n_local, calls=n_tensors).elementwise("inplace", n_local, calls=False).calls += n_tensors
        if layout.extras.get("parallel_job"):                 # clip over tp and pp, the loss's mean over dp
            coll("ring_all_reduce", 8, layout.tp, layout.tp)
            coll("ring_all_reduce", 8, p, p * span_dp)
            if dp > 1:
                coll("ring_all_reduce", 8, dp, span_dp)
    compute += step.seconds(tail)
    total = compute + comm + idle
    return {"compute": compute, "comm": comm, "bubble": idle, "total": total,
            "bubble_fraction": idle / span if p > 1 and span else 0.0, "comm_busy": comm_busy,
            "busy": compute / turns + comm_busy}


def _largest_activation(model, layout):
    """Elements of the largest array a micro-batch's forward makes (does it exceed the held heap's size?)."""
    b = layout.micro_batch_size
    if model.kind == "mlp":
        return b * max(model.sizes)
    s, t = model.block_size // layout.cp, layout.tp
    return b * max(s * model.ffn // t, model.n_head // t * s * model.block_size, s * -(-model.vocab_size // t))


def _layer_sizes(model, layout):
    """Each layer's parameter tensors (element counts), as the pipeline cuts the layers."""
    if model.kind == "mlp":
        return [[i * o, o] if k == "linear" else [] for k, i, o in model.modules()]
    from .experts import moe_mlp_sizes
    h, t, v, f = model.n_embd, layout.tp, -(-model.vocab_size // layout.tp), model.ffn
    attention = [2 * h, 3 * h * h // t + 3 * h // t, h * h // t + h, 2 * h]
    block = attention + [h * f // t + f // t, f * h // t + h]
    moe = attention + moe_mlp_sizes(model, layout) if model.moe_experts else block
    return ([[v * h, model.block_size * h]] + [moe if model.is_moe_layer(i) else block for i in range(model.n_layer)]
            + [[2 * h, v * h]])


def _expert_counts(model, layout):
    """Routed experts' parameters of each layer on a rank (reduced over dp/ep ranks, not dp)."""
    if model.kind != "gpt" or not model.moe_experts:
        return None
    from .experts import expert_params
    one = model.moe_experts // layout.ep * expert_params(model)
    return tuple([0] + [one if model.is_moe_layer(i) else 0 for i in range(model.n_layer)] + [0])


def _mlp_works(model, layout, rows):
    works = mlp_layer_work(model, layout, rows)
    return mlp_recompute(works, layout) if layout.recompute == "full" else works


def predict_nodes(model, layout, machine=None):
    """Graph nodes the rank that records the most records per step (the jobs report theirs)."""
    if model.kind == "params":
        return 0
    device = (machine or {}).get("device", "cpu")
    if model.kind == "mlp":
        works = _mlp_works(model, layout, layout.micro_batch_size)
    else:
        block = gpt_block_work(model, layout, layout.micro_batch_size, device)
        moe = gpt_block_work(model, layout, layout.micro_batch_size, device, moe=True) if model.moe_experts else block
        emb, head = gpt_ends_work(model, layout, layout.micro_batch_size, device)
        works = [emb] + [moe if model.is_moe_layer(i) else block for i in range(model.n_layer)] + [head]
    counts = tuple(sum(x) for x in _layer_sizes(model, layout))
    p, v = layout.pp, layout.chunks
    bounds, where = stage_bounds(counts, layout.schedule, p, v)          # as the runtime cuts and places them
    per_stage = [0] * p
    for (lo, hi), (rank, _) in zip(zip(bounds, bounds[1:]), where):
        per_stage[rank] += recorded_nodes(works[lo:hi], layout.microbatches)
    return max(per_stage)


@lru_cache(maxsize=1024)
def _prefix(layers, sizes, experts=None):
    """Parameter counts per layer, and running sums of (forward, its comm, backward, its comm, the comms' busy
    parts, parameters, tensors, routed experts' parameters) over the layers: a virtual stage's totals are a
    difference of two."""
    counts = tuple(sum(x) for x in sizes)
    experts = experts or (0,) * len(counts)
    rows = np.array([(*layer, n, len(sz), x) for layer, n, sz, x in zip(layers, counts, sizes, experts)], np.float64)
    return counts, np.vstack([np.zeros((1, 9)), np.cumsum(rows, axis=0)])


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
    s, h, L, f = model.block_size, model.n_embd, model.n_layer, model.ffn
    v_pad = -(-model.vocab_size // layout.tp) * layout.tp
    attention = 8 * B * s * h * h + 4 * B * s * s * h
    layer = attention + 4 * B * s * h * f                                    # one layer's forward
    recompute = {"full": layer, "selective": 4 * B * s * s * h}.get(layout.recompute, 0)
    dense = (L - model.num_moe_layers()) * (3 * layer + recompute)
    if model.moe_experts:                  # the router, k routed experts per token (capacity: fewer), the shared
        from .experts import routed_rows
        b = layout.micro_batch_size
        k = routed_rows(model, layout, b) / (b * (s // layout.cp))               # rows per token: k dropless
        moe = attention + 2 * B * s * h * model.moe_experts + 4 * B * s * h * model.expert_ffn * (k + model.moe_shared)
        dense += model.num_moe_layers() * (3 * moe + {"full": moe}.get(layout.recompute, recompute))
    return dense + 6 * B * s * h * v_pad

"""Step time: the work a rank does (plan/work.py: matmuls, the library's ops, graph nodes, counted from
the code) in seconds on the machine (plan/costs.py: matmuls at the calibrated FLOP rate of their size, one
product or a batch of them; each op at its calibrated cost per call and per element, plan/ops.py; the
engine's Python per node and per parameter given a gradient), alpha-beta communication (plan/alpha_beta.py),
and the pipeline schedule's own simulator (parallel.pipeline.simulate; plan/bubble.py) for the bubble.

Per micro-batch and stage, forward F and backward B = compute + communication (tensor-parallel
collectives: 2 all-reduces of b·s·h per layer each way, or with SP all-gathers and reduce-scatters,
plan/layer_costs.py; point-to-point activations between stages). simulate(schedule, F, B) on the slowest
stage's costs (zero-bubble schedules: W, the weights' gradients, counted apart from the rest of B) gives the
pipeline's span; bubble = span - the stage's own work. Then the step's tail: data-parallel gradient
reduction (DDP overlaps its buckets with backward), SP's sum of the replicated parameters' gradients over
tp, the optimizer.
"""
from functools import lru_cache

import numpy as np

from ..backend import default_blas_threads
from ..parallel.pipeline.schedules import SPLIT_BACKWARD
from .alpha_beta import collective
from .bubble import _bubble, _sig, _simulated
from .costs import Costs
from .counts import _layer_sizes, _mlp_works, sp_replicated_per_stage
from .layer_costs import gpt_layer_costs, weights
from .layout import PRECISIONS
from .stages import stage_bounds
from .work import Work, optimizer_work


def typical(machine, world, waited=False):
    """How much slower a job's median step does its CPU work than the calibrated constants, each a best case:
    the anchor's median as a job of ``world`` ranks meets it over its best (plan/anchor.typical_over_best:
    alone, or every rank of a 2-rank job at once; ``waited``: each run after a wait asleep, as a pipeline's
    stage computes once its input has come); 1 where not calibrated so. (A job's step timer runs the same
    anchor: a step in anchors times the calibrated anchor times this is a quiet median step.) A pipeline's
    stages (``waited``) compute at least as slowly as the ranks of any job that fills the cores: two quiet
    calibrations' factors differ by more than the wait makes them (1.07-1.24), so the larger one counts."""
    if world == 1:
        return max(1.0, machine.get("typical_alone", 1.0))
    job = machine.get("typical_job", 1.0)
    return max(1.0, job, machine.get("typical_job_waited", job) if waited else job)


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
        layers = [(c.seconds(f), 0.0, c.seconds(b), 0.0, 0.0, 0.0, weights(c, b))
                  for f, b in _mlp_works(model, layout, rows)]
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
    # parts, W's part of the backward, params, tensors, routed experts' params)
    work = np.zeros((p, 10))
    np.add.at(work, owner, prefix[bounds[1:]] - prefix[bounds[:-1]])
    slowest = int(np.argmax(work[:, :4].sum(axis=1)))
    fc, fm, bc, bm, fo, bo, wc, n_local, n_tensors, n_experts = work[slowest].tolist()
    n_local, n_tensors, n_experts = int(n_local), int(n_tensors), int(n_experts)
    if p > 1 and "pipeline_message_s" in machine:           # a message as the runtime meets it, between stages
        message = machine["pipeline_message_s"] + machine["pipeline_message_byte_s"] * act
        stages = prefix[bounds[1:]] - prefix[bounds[:-1]]    # each virtual stage at its own cost: a light
        span = _simulated(layout.schedule, p, m, v, _sig(stages[:, 0] + stages[:, 1]),  # stage's outputs come
                          _sig(stages[:, 2] + stages[:, 3]), _sig([message])[0],        # early to a heavy one
                          _sig(stages[:, 6]))
        idle = max(0.0, span - m * (fc + fm + bc + bm))
    elif p > 1:                                              # a header, then the activation (or its gradient)
        hop = v * (collective(machine, "p2p", act, 2, 2 * layout.tp * layout.dp) + collective(machine, "p2p", 80, 2))
        fm, bm = fm + hop, bm + hop                          # (their busy part: in the calibrated action's)
        span, idle = _bubble(layout.schedule, p, m, v, (fc + fm) / v, (bc + bm) / v,   # the schedule's simulator
                             wc / (bc + bm) if bc + bm else 0.5)
    else:
        span, idle = m * (fc + fm + bc + bm), 0.0
    compute, comm, comm_busy = m * (fc + bc), m * (fm + bm), m * (fo + bo)

    def coll(name, nbytes, p, span=None, times=1.0, own_thread=True):
        """A collective of the tail: its wall time to comm; its busy part to comm_busy if this thread runs it.
        One on the progress thread beside the compute is priced as a job meets it (alpha_beta.collective)."""
        nonlocal comm, comm_busy
        comm += times * collective(machine, name, nbytes, p, span, in_job=not own_thread)
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
        N, span_zero = layout.zero_ranks, span_dp * layout.cp     # (GPT3D's ZeRO spans the dp x cp replicas)
        coll("ring_reduce_scatter", grad_bytes, N, span_zero, own_thread=z == 1)
        coll("ring_all_gather", grad_bytes, N, span_zero)
        shard = -(-n_local // N)                             # ZeRO-1 zeroes the flat gradient, ZeRO-2 copies
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
        moe_dp = n_experts and layout.ep > 1 and layout.extras.get("moe_dp_job")
        if n_experts and rest > 1 and not moe_dp:
            coll("ring_all_reduce", n_experts * e, rest, span_dp * cp)
        if moe_dp:              # the experts' gradients concatenated, reduced, each divided by dp (one call a tensor)
            for name, nbytes, ranks in expert_dp_collectives(model, layout):
                coll(name, nbytes, ranks, span_dp * cp)
            tail.op("copy", n_experts).elementwise("simple", n_experts, 1, calls=False)
            tail.calls += expert_tensors(model, layout)
        tail.elementwise("simple", n_local, 3 if dp > 1 else 0, calls=False)
        tail.calls += 2 * n_tensors if dp > 1 else 0
    if model.kind == "gpt" and layout.sequence_parallel and layout.tp > 1:
        # each tp rank's replicated parameters (LayerNorms, wpe, biases, MoE layers) saw its own tokens: their
        # partial gradients summed over tp at the step's end, one flat all-reduce (all_reduce_coalesced)
        for name, nbytes, ranks in sp_step_end_collectives(model, layout)[slowest]:
            coll(name, nbytes, ranks, layout.tp)
        n_replicated, replicated_tensors = sp_replicated_per_stage(model, layout)[slowest]
        tail.op("copy", n_replicated, count=2, calls=1 + replicated_tensors)   # into the flat buffer and back
    if p > 1 or layout.extras.get("parallel_job"):           # the pipeline runtime's own work per action
        tail.actions += 2 * m * v                            # (and per byte it sends or receives)
        compute += step.slowdown * 2 * m * v * machine.get("pipeline_action_byte_s", 0.0) * (act if p > 1 else 0)
    if layout.schedule in SPLIT_BACKWARD and p > 1:        # W visits each node with a weight a second time:
        tail.nodes += m * n_tensors                          # as a graph node per parameter tensor (a Linear's or a
        #   LayerNorm's node makes two gradients: B's test of every node and W's second call, measured in jobs)
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


def sp_step_end_collectives(model, layout):
    """Per pipeline rank, (name, bytes, ranks) of what sequence parallelism runs over tp after a step's
    backward (TensorParallelGPT.all_reduce_replicated_grads): with experts first a used-flag (float64) per
    replicated tensor of the whole model (pipeline/step_end.used_anywhere), then the stage's replicated
    parameters' gradients all-reduced as one array."""
    e, t = PRECISIONS[layout.precision], layout.tp
    flags = sum(n for _, n in sp_replicated_per_stage(model, layout))     # the stages' tensors: the model's
    return [([("ring_all_reduce", 8 * flags, t)] if model.moe_experts else []) + [("ring_all_reduce", n * e, t)]
            for n, _ in sp_replicated_per_stage(model, layout)]


def expert_tensors(model, layout):
    """Routed experts' parameter tensors on a rank: c_fc's and c_proj's weight and bias, E/ep per MoE layer."""
    return 4 * model.num_moe_layers() * (model.moe_experts // layout.ep)


def expert_dp_collectives(model, layout):
    """(name, bytes, ranks) of what expert_data_parallel.py runs after a data-parallel MoE job's backward under
    ep: the experts' gradients all-reduced as one array over the dp/ep ranks holding the same experts (a call even
    over one rank), one float64 used-flag per tensor alike; clip_grad_norm_'s sum of squares over the ep ranks."""
    from .experts import expert_params_per_rank
    rest, e = layout.dp // layout.ep, PRECISIONS[layout.precision]
    return [("ring_all_reduce", expert_params_per_rank(model, layout) * e, rest),
            ("ring_all_reduce", 8 * expert_tensors(model, layout), rest), ("ring_all_reduce", 8, layout.ep)]


def _largest_activation(model, layout):
    """Elements of the largest array a micro-batch's forward makes (does it exceed the held heap's size?)."""
    b = layout.micro_batch_size
    if model.kind == "mlp":
        return b * max(model.sizes)
    s, t = model.block_size // layout.cp, layout.tp
    return b * max(s * model.ffn // t, model.n_head // t * s * model.block_size, s * -(-model.vocab_size // t))


def _expert_counts(model, layout):
    """Routed experts' parameters of each layer on a rank (reduced over dp/ep ranks, not dp)."""
    if model.kind != "gpt" or not model.moe_experts:
        return None
    from .experts import expert_params
    one = model.moe_experts // layout.ep * expert_params(model)
    return tuple([0] + [one if model.is_moe_layer(i) else 0 for i in range(model.n_layer)] + [0])


@lru_cache(maxsize=1024)
def _prefix(layers, sizes, experts=None):
    """Parameter counts per layer, and running sums of (forward, its comm, backward, its comm, the comms' busy
    parts, W's part of the backward, parameters, tensors, routed experts' parameters) over the layers: a
    virtual stage's totals are a difference of two."""
    counts = tuple(sum(x) for x in sizes)
    experts = experts or (0,) * len(counts)
    rows = np.array([(*layer, n, len(sz), x) for layer, n, sz, x in zip(layers, counts, sizes, experts)], np.float64)
    return counts, np.vstack([np.zeros((1, 10)), np.cumsum(rows, axis=0)])



"""Where to cut a Sequential into pipeline stages, and what an uneven cut costs.

Each layer's cost is counted, not timed: by default the multiply-adds per input row of its
forward, input-gradient and weight-gradient work, from its parameter count n (a Linear's forward
is n per row, so are its B and its W): 3n, but 2n for the model's first layer with parameters,
whose input needs no gradient (no B: the layers before it have nothing to learn). A parameter-free
layer such as ReLU counts 0; pass layer_costs to count otherwise (an embedding's n is no FLOP
count). The cut is the classic linear partition: contiguous groups whose largest cost is as small as
possible. Layers do not always divide evenly; the pipeline then runs at the pace of its slowest
stage, and implied_bubble says what that costs: the schedule simulated with F = B = W = each
virtual stage's cost (the balanced formula is the special case of equal costs). stage_layout
is the whole answer (where to cut, which rank and chunk holds each part): the runtime and the
planner (minitrain/plan) both ask it, so the planner predicts the layout the job runs.
"""
import math
from functools import lru_cache

from ...backend import array_module
from ...nn import Sequential
from .schedules import default_chunks
from .simulator import simulate


def parameter_costs(layers):
    """Each layer's number of parameters."""
    return [sum(q.size for q in layer.parameters()) for layer in layers]


def counted_costs(parameters):
    """Counted cost per layer from its parameter count n: F + B + W multiply-adds per row, 3n; the
    first layer with parameters 2n (its input gradient is never computed)."""
    first = next((i for i, n in enumerate(parameters) if n), None)
    return [(2 if i == first else 3) * n for i, n in enumerate(parameters)]


def balanced_split_points(sizes, parts):
    """Where each of parts contiguous groups of layers starts (after the first), chosen so that
    the largest group's cost is as small as possible (dynamic programme over the prefix sums); a
    group of free layers alone is avoided whenever enough layers cost something."""
    n = len(sizes)
    if n < parts:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline stages: each needs at least one layer")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    weighted = [0]
    for size in sizes:
        weighted.append(weighted[-1] + (size > 0))
    avoid_empty = weighted[-1] >= parts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]   # best[k][i]: first i layers in k groups
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if avoid_empty and weighted[i] == weighted[j]:
                    continue                              # this group would hold no parameters
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], start[k][i] = cost, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = start[k][i]
        points.append(i)
    return sorted(points)[1:]


@lru_cache(maxsize=256)
def virtual_placement(schedule_name, p, chunks=None):
    """For each virtual stage, the (rank, chunk) that holds it, as the schedule places it: stage k
    on rank k % p as chunk k // p (one chunk, or the interleaved loop), or zbv's V (down the ranks
    as chunk 0, back up as chunk 1). The runtime checks it against its schedule's own placement."""
    v = default_chunks(schedule_name, chunks)
    if schedule_name == "zbv":
        return tuple((k, 0) if k < p else (2 * p - 1 - k, 1) for k in range(2 * p))
    return tuple((k % p, k // p) for k in range(p * v))


def stage_layout(costs, schedule_name, p, chunks=None, split_points=None):
    """(bounds, where): virtual stage k holds layers bounds[k]:bounds[k + 1] (balanced by
    costs unless split_points says where) on where[k] = (rank, chunk)."""
    if not all(math.isfinite(cost) and cost >= 0 for cost in costs):     # (NaN would price every cut alike)
        raise ValueError(f"layer costs must be finite numbers >= 0, got {list(costs)}")
    where = virtual_placement(schedule_name, p, chunks)
    if split_points is None:
        split_points = balanced_split_points(list(costs), len(where)) if len(where) > 1 else []
    return [0] + list(split_points) + [len(costs)], list(where)


def stage_table(layers, bounds, costs, where):
    """One row per virtual stage: its rank and chunk, its layers (index: name) and cost share."""
    total = sum(costs) or 1
    rows = []
    for k, (rank, chunk) in enumerate(where):
        part = range(bounds[k], bounds[k + 1])
        rows.append({"virtual_stage": k, "rank": rank, "chunk": chunk,
                     "layers": [f"{i}:{type(layers[i]).__name__}" for i in part],
                     "cost": sum(costs[i] for i in part), "cost_share": sum(costs[i] for i in part) / total})
    return rows


def own_stages(model, bounds, where, rank, names):
    """This rank's part of the Sequential ``model`` cut at ``bounds`` and placed as ``where``:
    ({chunk: Sequential of its virtual stage}, {chunk: virtual stage}, {parameter name: owning rank});
    the layers other ranks own are freed (their shapes kept). names: id(parameter) -> its name."""
    layers, stages, virtual, owner = list(model), {}, {}, {}
    for k, (stage_rank, chunk) in enumerate(where):
        part = layers[bounds[k]:bounds[k + 1]]
        for layer in part:
            for q in layer.parameters():
                owner[names[id(q)]] = stage_rank
        if stage_rank == rank:
            stages[chunk], virtual[chunk] = Sequential(*part), k
    local = {id(q) for stage in stages.values() for q in stage.parameters()}
    xp = array_module(next(iter(model.parameters())).data)
    for q in model.parameters():
        if id(q) not in local:
            q.data = xp.broadcast_to(xp.zeros((), q.dtype), q.shape)
    return stages, virtual, owner


def implied_bubble(schedule, stage_costs):
    """The bubble of schedule when virtual stage k costs stage_costs[k] in each of F, B and
    W: unequal stages make the light ones wait for the heavy one."""
    mean = sum(stage_costs) / len(stage_costs) or 1.0
    costs = [c / mean for c in stage_costs]
    return simulate(schedule, costs, costs, costs)["bubble_fraction"]


def format_stage_table(rows, formula=None, implied=None):
    """The table the job prints: what each stage holds and how much of the work."""
    out = [f"  {'stage':>5} {'rank':>4} {'chunk':>5} {'cost share':>10}  layers"]
    for r in rows:
        out.append(f"  {r['virtual_stage']:>5} {r['rank']:>4} {r['chunk']:>5} {r['cost_share']:>10.1%}  "
                   + " ".join(r["layers"]))
    shares = [r["cost_share"] for r in rows]
    if max(shares) > 1.05 * min(shares) and implied is not None:
        out.append(f"  stages are unequal (largest {max(shares):.1%}, smallest {min(shares):.1%} of the cost): "
                   f"the layers cannot be cut evenly; the slowest stage sets the pace, implied bubble "
                   f"{implied:.3f}" + (f" against {formula:.3f} for equal stages" if formula is not None else ""))
    return "\n".join(out)

"""A pipeline's stages as the runtime lays them out: which layers each virtual stage holds, on which rank and
chunk (pipeline/partition.py's own calls; Megatron's even split for paper-scale models), and how many
micro-batches a stage holds in flight at its backwards (from the schedule's own action list).
"""
from functools import lru_cache

from ..parallel.pipeline import get_schedule
from ..parallel.pipeline.partition import counted_costs, stage_layout


@lru_cache(maxsize=256)
def stage_bounds(sizes, schedule, p, v):
    """(bounds, where) as the runtime lays out layers of these parameter counts (pipeline/partition.py's
    ``counted_costs`` and ``stage_layout``: the same calls): virtual stage k holds layers bounds[k]:bounds[k+1] on rank and chunk
    where[k]. Paper-scale models (beyond what the runtime's dynamic programme is for) get Megatron's even
    split of the blocks."""
    parts = p * v
    points = None
    if len(sizes) ** 2 * parts > 60_000:                     # Megatron's even split for paper-scale models
        per = (len(sizes) - 2) // parts
        points = [1 + per * k for k in range(1, parts)]
    bounds, where = stage_layout(counted_costs(sizes), schedule, p, v, split_points=points)
    return tuple(bounds), tuple(where)


@lru_cache(maxsize=512)
def _schedule(name, p, m, v):
    return get_schedule(name, p, m, chunks=v)


@lru_cache(maxsize=4096)
def in_flight(name, p, m, stage):
    """For a one-chunk schedule, stage ``stage``'s micro-batches in flight at its first backward and the
    most at a later backward (0: none) — all that the memory walk needs when chunks are alike.
    Beyond m = 4p they are extrapolated from the schedule at 2p and 3p micro-batches (constant for
    1F1B, m for GPipe: linear once every stage is in its steady state; tests check both)."""
    if m > 4 * p:
        a, b = _in_flight(name, p, 2 * p, stage), _in_flight(name, p, 3 * p, stage)
        return tuple(int(x + (y - x) * (m - 2 * p) / p) for x, y in zip(a, b))
    return _in_flight(name, p, m, stage)


@lru_cache(maxsize=4096)
def _in_flight(name, p, m, stage):
    return counts_in_flight(_schedule(name, p, m, 1)[stage])


def counts_in_flight(actions):
    """(in flight at the first backward, the most at a later one): see ``in_flight``. Zero-bubble
    schedules keep a micro-batch's activations until its W (the deferred weight gradients need the
    layers' inputs), so there W is the backward that frees them and B frees nothing."""
    n = b_first = b_later = 0
    split = any(a.kind == "W" for a in actions)
    for a in actions:
        if a.kind == "F":
            n += 1
            continue
        if split and a.kind == "B":
            continue
        b_first, b_later = (b_first, max(b_later, n)) if b_first else (n, b_later)
        n -= 1
    return b_first, b_later


def stage_chunks(pieces, layout, paper=False):
    """Per stage, chunk -> its pieces, cut and placed as the runtime does (``stage_bounds``: balanced by
    counted F + B + W cost, the schedule's placement: the interleaved loop, zbv's V), or for the paper's accounting
    L/(p·v) blocks per virtual stage (Megatron's rule)."""
    p, v = layout.pp, layout.chunks
    bounds, where = stage_bounds(tuple(x.params for x in pieces), layout.schedule, p, v)
    if paper:
        per = (len(pieces) - 2) // (p * v)
        bounds = [0] + [1 + per * k for k in range(1, p * v)] + [len(pieces)]
    stages = [dict() for _ in range(p)]
    for virtual, (rank, chunk) in enumerate(where):
        stages[rank][chunk] = pieces[bounds[virtual]:bounds[virtual + 1]]
    return stages

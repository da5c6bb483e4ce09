"""The pipeline's bubble, from the schedule's own simulator (parallel.pipeline.simulate): the idle time per
stage at a backward/forward ratio (GPipe, 1F1B, and interleaving when p divides m: p - 1 chunk-times, Huang et
al. 2019, Narayanan et al. 2021; the others simulated), or, with a calibrated stage-to-stage message, the
span of the schedule with each virtual stage at its own cost.
"""
import inspect
import math
from functools import lru_cache

from ..parallel.pipeline import get_schedule, simulate


def _bubble(name, p, m, v, f, b, w_share=0.5):
    """(span, idle seconds per stage) of the schedule with forward f and backward b per chunk (zero-bubble
    schedules: W the ``w_share`` of b, to two digits), from the schedule's own simulator (at backward/forward
    ratios 1.5^k, interpolated). Beyond m = 2p micro-batches
    the idle time is taken as constant: once every stage reaches its steady state it stops growing
    (exact for GPipe, 1F1B and interleaving; tests/test_plan.py checks it against full simulations).
    (With a calibrated message cost: _simulated.)"""
    probe = m if m <= 2 * p else 2 * p
    if name == "interleaved_1f1b" and probe % p:
        probe = m
    step = math.log(b / f, 1.5) if f > 0 and b > 0 else 0.0    # simulated at ratios 1.5^k, interpolated
    lo, share = math.floor(step), round(w_share, 2)
    idle_unit = _idle(name, p, probe, v, lo, share) + (step - lo) * (
        _idle(name, p, probe, v, lo + 1, share) - _idle(name, p, probe, v, lo, share))
    return m * v * (f + b) + idle_unit * (f + b), idle_unit * (f + b)


def _sig(values):
    """Seconds to three significant digits, as a tuple (a cache key for _simulated)."""
    return tuple(float(f"{x:.3g}") for x in values)


@lru_cache(maxsize=4096)
def _simulated(name, p, m, v, f, b, message, w):
    """The span of the schedule simulated at each virtual stage's forward f[k] and backward b[k] (seconds per
    micro-batch; zero-bubble schedules: W the w[k] of it, the rest B) and ``message``: the seconds from a
    stage's compute ending to the next stage having its output (calibrated as the runtime meets it,
    plan/job_overheads.py). A message comparable to an action puts the stages in lockstep (1F1B at p = 2: each
    backward waits for a round trip), so the idle time grows with m and no longer scales with f + b: no
    shortcut (_bubble's) holds, and a stage lighter than the slowest sends early enough to hide messages."""
    kwargs = {"forward_cost": f, "backward_cost": b}
    if "weight_cost" in inspect.signature(simulate).parameters:   # zero-bubble schedules split B and W
        kwargs = {"forward_cost": f, "backward_cost": tuple(x - y for x, y in zip(b, w)), "weight_cost": w}
    return simulate(get_schedule(name, p, m, chunks=v), message_cost=message, **kwargs)["total_time"]


@lru_cache(maxsize=4096)
def _idle(name, p, m, v, k, w_share=0.5):
    """Idle time per stage, in units of (f + b), when backward costs 1.5^k times the forward (zero-bubble
    schedules: W the ``w_share`` of it). GPipe and
    1F1B (and interleaving when p divides m) idle p - 1 chunk-times at any ratio (Huang et al.; Narayanan et
    al.): the simulator gives exactly that (tests/test_plan.py), so --search does not run it for them."""
    if name in ("gpipe", "1f1b") or (name == "interleaved_1f1b" and m % p == 0):
        return float(p - 1)
    ratio = 1.5 ** k
    f, b = 1 / (1 + ratio), ratio / (1 + ratio)
    kwargs = {"forward_cost": f, "backward_cost": b}
    if "weight_cost" in inspect.signature(simulate).parameters:   # zero-bubble schedules split B and W
        kwargs = {"forward_cost": f, "backward_cost": b * (1 - w_share), "weight_cost": b * w_share}
    sim = simulate(get_schedule(name, p, m, chunks=v), **kwargs)
    return sim["total_time"] - m * v * (f + b)

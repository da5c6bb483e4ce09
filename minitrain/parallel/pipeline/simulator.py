"""The pipeline simulator and checker: a schedule (schedules.py) run on an idealised machine.

simulate() runs each stage's actions in order, each as soon as its inputs exist, with the costs
given (unit, or measured per virtual stage; a message priced as LogP prices it, Culler et al.
1993: latency plus the sender's and the receiver's overhead). check_schedule() proves a schedule
deadlock-free and causally sound by running it; formula_bubble_fraction() is the literature's
bubble, or the simulator's where a schedule has no closed form (zb_h1, zbv).
"""
from numbers import Number

from .schedules import SPLIT_BACKWARD, ScheduleError, get_schedule, num_chunks, placement, splits_backward, virtual_stage


def _dependencies(action, virtual, last):
    """(kind, step, microbatch, virtual stage) units this action waits for."""
    key = (action.step, action.microbatch)
    if action.kind == "F":
        return [("F", *key, virtual - 1)] if virtual > 0 else []
    if action.kind == "W":
        return [("B", *key, virtual)]
    deps = [("F", *key, virtual)]
    if virtual < last:
        deps.append(("B", *key, virtual + 1))
    return deps


def _cost(cost, virtual):
    return cost if isinstance(cost, Number) else cost[virtual]


def _duration(action, virtual, split, forward_cost, backward_cost, weight_cost):
    if action.kind == "F":
        return _cost(forward_cost, virtual)
    if action.kind == "W":
        return _cost(weight_cost, virtual)
    return _cost(backward_cost, virtual) + (0.0 if split else _cost(weight_cost, virtual))


def simulate(schedule, forward_cost=1.0, backward_cost=2.0, weight_cost=0.0, message_cost=0.0,
             send_overhead=0.0, receive_overhead=0.0, action_cost=None):
    """Run the schedule on an idealised machine: each stage runs its actions in order, each as
    soon as its inputs exist. Costs are per action of one chunk: a number, or a sequence indexed
    by virtual stage (unequal stages). backward_cost is B, the input-gradient part; weight_cost is
    W; a schedule that does not split them runs B + W as one backward (with the default W = 0,
    backward_cost is the whole backward). A message between stages costs as in LogP (Culler et al.
    1993): send_overhead, the producing stage's time posting it after the action that made it;
    message_cost, the latency from then until a consumer waiting for it has it; receive_overhead,
    the consuming stage's time taking a message that is already there. The overheads are stage time
    but not work: idle in the bubble. One virtual stage handing over to the next on the same stage
    costs nothing; all zero: free communication. action_cost(stage, i), if given, is the i-th
    action's own duration on that stage instead (a measured step, action by action). Pure: returns a dict

    * timeline: per stage, a list of (action, start, end);
    * total_time: when the last action ends (every stage starts at 0);
    * bubble_fraction: idle share of p x total time; bubble_per_stage: 1 - busy / total;
    * idle_per_stage: total - busy, in the costs' unit; of it, send_per_stage: posting messages,
      transfer_per_stage: from a message being posted (or the stage asking, if later) to the
      stage having it (measure.py splits a real step the same way; the rest is waiting);
    * peak_activations: per stage, the most micro-batch chunks whose forward has run and whose
      last backward piece (W where it is split off, else B) has not: what is held in memory.

    Raises ScheduleError if the schedule deadlocks or breaks happens-before."""
    p = len(schedule)
    check_complete(schedule)
    where = placement(schedule)
    last = len(where) - 1
    split = splits_backward(schedule)
    done, posted = {}, {}           # (kind, step, mb, virtual) -> end time; -> its message posted
    position, clock = [0] * p, [0.0] * p
    sending, transfer = [0.0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    in_flight, peak = [0] * p, [0] * p
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                virtual = virtual_stage(action, s, p)
                deps = _dependencies(action, virtual, last)
                if any(d not in done for d in deps):
                    break
                cost = (action_cost(s, position[s]) if action_cost is not None
                        else _duration(action, virtual, split, forward_cost, backward_cost, weight_cost))
                crossing = [d for d in deps if where[d[3]][0] != s]
                ready = clock[s] + (receive_overhead if crossing else 0.0)
                start = max([ready] + [posted[d] + message_cost if d in crossing else done[d] for d in deps])
                if crossing:
                    transfer[s] += start - max([clock[s]] + [posted[d] for d in crossing])
                end = start + cost
                key = (action.kind, action.step, action.microbatch, virtual)
                sends = action.send_to not in (None, s)
                done[key], posted[key] = end, end + (send_overhead if sends else 0.0)
                timeline[s].append((action, start, end))
                sending[s] += posted[key] - end
                clock[s] = posted[key]
                if action.kind == "F":
                    in_flight[s] += 1
                elif action.kind == ("W" if split else "B"):
                    in_flight[s] -= 1
                peak[s] = max(peak[s], in_flight[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = "; ".join(f"stage {s} waits at {schedule[s][position[s]]} (action #{position[s]})"
                                for s in range(p) if position[s] < len(schedule[s]))
            raise ScheduleError(f"the schedule deadlocks: {blocked}")
    total = max(clock)
    busy = [sum(e - b for _, b, e in timeline[s]) for s in range(p)]
    return {"timeline": timeline, "total_time": total,
            "bubble_fraction": 1 - sum(busy) / (p * total) if total else 0.0,
            "bubble_per_stage": [1 - b / total if total else 0.0 for b in busy],
            "idle_per_stage": [total - b for b in busy], "send_per_stage": sending, "transfer_per_stage": transfer,
            "peak_activations": peak}


def check_complete(schedule):
    """Every (micro-batch, chunk) is computed forward and backward exactly once on its stage (and
    W too, on every stage, if any stage splits it off), B after its F and W after its B."""
    v = num_chunks(schedule)
    kinds = "FBW" if splits_backward(schedule) else "FB"
    before = {"B": "F", "W": "B"}
    for s, actions in enumerate(schedule):
        seen = {}
        for i, a in enumerate(actions):
            key = (a.kind, a.step, a.microbatch, a.chunk)
            if a.kind not in "FBW":
                raise ScheduleError(f"stage {s}: unknown action kind {a.kind!r} (action #{i})")
            if key in seen:
                raise ScheduleError(f"stage {s} computes {a} twice (actions #{seen[key]} and #{i})")
            seen[key] = i
            if a.kind in before and (before[a.kind], a.step, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"stage {s}: {a} (action #{i}) comes before its "
                                    f"{'forward' if a.kind == 'B' else 'input-gradient backward B'}")
        units = {(step, mb) for (_, step, mb, _) in seen}
        for step, mb in units:
            for c in range(v):
                for kind in kinds:
                    if (kind, step, mb, c) not in seen:
                        raise ScheduleError(f"stage {s} never computes {kind}{mb}.{c} (step {step})"
                                            + (" (the schedule splits W from B elsewhere)" if kind == "W" else ""))
    counts = {len({(a.step, a.microbatch) for a in actions}) for actions in schedule}
    if len(counts) > 1:
        raise ScheduleError(f"stages disagree on the number of micro-batches: {sorted(counts)}")
    return True


def check_schedule(schedule):
    """Prove the schedule deadlock-free and causally sound by running it (raises ScheduleError)."""
    simulate(schedule, 1.0, 1.0, 1.0)
    return True


def formula_bubble_fraction(name, p, m, v=1, forward_cost=1.0, backward_cost=1.0, weight_cost=1.0):
    """The literature's bubble: (p-1)/p for naive, (p-1)/(v·m + p - 1) for GPipe, 1F1B and
    interleaved (any costs); for zb_h1 and zbv, which have no closed form at every m and cost, the
    simulator's bubble at the given F, B, W (unit costs by default: ZB-H1 is then
    (p-1)/(3m + p - 1) for m >= p, idle (p-1)(F+B-W) per stage)."""
    if name == "naive":
        return (p - 1) / p
    if name in SPLIT_BACKWARD:
        schedule = get_schedule(name, p, m)
        return simulate(schedule, forward_cost, backward_cost, weight_cost)["bubble_fraction"]
    return (p - 1) / (v * m + p - 1)

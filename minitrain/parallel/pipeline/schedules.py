"""Pipeline schedules as pure data, a checker, and a simulator.

A schedule is, for each stage (rank) s of a pipeline of p stages, the ordered list of what that
stage computes: Action("F", microbatch, chunk) (forward) and Action("B", microbatch, chunk)
(backward). The model is cut into p·v *virtual stages*; chunk c on stage s is virtual stage
c·p + s (Narayanan et al. 2021's interleaving; v = 1 otherwise). The communication is implied and
spelled out on each action: a forward receives its input from virtual stage k-1 and sends its
output to k+1; a backward receives the output's gradient from k+1 and sends the input's gradient
to k-1 (recv_from / send_to, as stage indices, None at the ends).

* naive: one micro-batch at a time through the whole pipeline (model parallelism without
  pipelining); bubble (p-1)/p.
* gpipe (Huang et al. 2019): all m forwards, then all m backwards; m micro-batches in flight.
* 1f1b (PipeDream-Flush, Narayanan et al. 2021): p-s-1 warm-up forwards, then one forward /
  one backward alternating, then the remaining backwards; same bubble as GPipe, min(p-s, m) in flight.
* interleaved_1f1b (Narayanan et al. 2021, Megatron-LM): v chunks per stage, bubble cut by v.
* pipedream_2bw (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
  1F1B with no flush between batches, steps batches back to back; each action carries the batch
  (step) its micro-batch belongs to. Its weights are double-buffered (see runtime.py).

With unit costs (forward f, backward b per chunk) GPipe, 1F1B and interleaved take
(v·m + p - 1)(f + b): the bubble fraction is (p-1)/(v·m + p - 1).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str                 # "F" forward, "B" backward
    microbatch: int
    chunk: int = 0
    recv_from: int = None     # stage index the input (F) or the gradient (B) comes from
    send_to: int = None       # stage index the output (F) or the input gradient (B) goes to
    step: int = 0             # pipedream_2bw: the batch this micro-batch belongs to

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A schedule that would deadlock, or breaks happens-before."""


def _with_comm(kind, mb, chunk, stage, p, v, step=0):
    virtual = chunk * p + stage
    prev_stage = (virtual - 1) % p if virtual > 0 else None
    next_stage = (virtual + 1) % p if virtual < p * v - 1 else None
    if kind == "F":
        return Action("F", mb, chunk, prev_stage, next_stage, step)
    return Action("B", mb, chunk, next_stage, prev_stage, step)


def naive(p, m):
    """Micro-batch by micro-batch: forward through all stages, then backward, then the next one."""
    return [[a for mb in range(m) for a in (_with_comm("F", mb, 0, s, p, 1), _with_comm("B", mb, 0, s, p, 1))]
            for s in range(p)]


def gpipe(p, m):
    """All forwards, then all backwards (the last micro-batch first, as it finishes last)."""
    return [[_with_comm("F", mb, 0, s, p, 1) for mb in range(m)] +
            [_with_comm("B", mb, 0, s, p, 1) for mb in reversed(range(m))] for s in range(p)]


def _warmup_steady_cooldown(fwd, bwd, warmup):
    """``warmup`` forwards, then one forward / one backward alternating, then the last backwards."""
    actions = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        actions += [fwd[warmup + i], bwd[i]]
    return actions + bwd[len(bwd) - warmup:]


def one_f_one_b(p, m, steps=1):
    """PipeDream-Flush: warm up with p-s-1 forwards, alternate, drain. ``steps`` > 1 chains
    batches without a flush (that is PipeDream-2BW's timing)."""
    total = m * steps
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, total)
        fwd = [_with_comm("F", i % m, 0, s, p, 1, i // m) for i in range(total)]
        bwd = [_with_comm("B", i % m, 0, s, p, 1, i // m) for i in range(total)]
        schedule.append(_warmup_steady_cooldown(fwd, bwd, warmup))
    return schedule


def interleaved_1f1b(p, m, v):
    """Megatron's interleaved 1F1B: v model chunks per stage, micro-batches in groups of p."""
    if v < 1:
        raise ValueError(f"interleaved_1f1b: chunks must be >= 1, got {v}")
    if m % p:
        raise ValueError(f"interleaved_1f1b needs the number of micro-batches ({m}) to be a multiple of "
                         f"the number of stages ({p}): micro-batches go round the chunks in groups of {p}")
    total = m * v

    def unit(k, backward):
        group = k // p
        chunk = group % v
        if backward:
            chunk = v - 1 - chunk
        return (group // v) * p + k % p, chunk

    schedule = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        fwd = [_with_comm("F", *unit(k, False), s, p, v) for k in range(total)]
        bwd = [_with_comm("B", *unit(k, True), s, p, v) for k in range(total)]
        schedule.append(_warmup_steady_cooldown(fwd, bwd, warmup))
    return schedule


NAMES = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "pipedream_2bw")


def get_schedule(name, num_stages, num_microbatches, chunks=1, steps=1):
    """Per stage, the ordered list of Actions. ``chunks`` only for interleaved_1f1b; ``steps``
    (batches chained without a flush) only for pipedream_2bw."""
    p, m = num_stages, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs >= 1 stage and >= 1 micro-batch, got {p} and {m}")
    if chunks != 1 and name != "interleaved_1f1b":
        raise ValueError(f"chunks={chunks} needs the interleaved_1f1b schedule, not {name!r}")
    if name == "naive":
        return naive(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, chunks)
    if name == "pipedream_2bw":
        return one_f_one_b(p, m, steps)
    raise ValueError(f"unknown schedule {name!r}: expected one of {NAMES}")


def num_chunks(schedule):
    return 1 + max(a.chunk for actions in schedule for a in actions)


def _dependencies(action, stage, p, v):
    """(kind, step, microbatch, virtual stage) units this action waits for."""
    virtual = action.chunk * p + stage
    key = (action.step, action.microbatch)
    if action.kind == "F":
        return [("F", *key, virtual - 1)] if virtual > 0 else []
    deps = [("F", *key, virtual)]
    if virtual < p * v - 1:
        deps.append(("B", *key, virtual + 1))
    return deps


def simulate(schedule, forward_cost=1.0, backward_cost=2.0):
    """Run the schedule on an idealised machine (free communication; each stage runs its actions
    in order, each as soon as its inputs exist). Returns a dict: ``timeline`` (per stage, a list of
    (action, start, end)), ``total_time``, ``bubble_fraction`` (idle share of p x total time),
    ``bubble_per_stage`` and ``peak_activations`` (per stage, micro-batch chunks whose forward is
    done and backward is not). Raises ScheduleError if the schedule deadlocks or breaks
    happens-before (a backward before its forward, a unit computed twice or never)."""
    p = len(schedule)
    v = num_chunks(schedule)
    check_complete(schedule)
    done = {}                       # (kind, step, mb, virtual) -> end time
    position = [0] * p
    clock = [0.0] * p
    timeline = [[] for _ in range(p)]
    in_flight, peak = [0] * p, [0] * p
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                deps = _dependencies(action, s, p, v)
                if any(d not in done for d in deps):
                    break
                cost = forward_cost if action.kind == "F" else backward_cost
                start = max([clock[s]] + [done[d] for d in deps])
                end = start + cost
                done[(action.kind, action.step, action.microbatch, action.chunk * p + s)] = end
                timeline[s].append((action, start, end))
                clock[s] = end
                in_flight[s] += 1 if action.kind == "F" else -1
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
            "bubble_per_stage": [1 - b / total for b in busy], "peak_activations": peak}


def check_complete(schedule):
    """Every (micro-batch, chunk) is computed forward and backward exactly once on its stage, and
    each backward comes after its forward in that stage's list."""
    v = num_chunks(schedule)
    for s, actions in enumerate(schedule):
        seen = {}
        for i, a in enumerate(actions):
            key = (a.kind, a.step, a.microbatch, a.chunk)
            if key in seen:
                raise ScheduleError(f"stage {s} computes {a} twice (actions #{seen[key]} and #{i})")
            seen[key] = i
            if a.kind == "B" and ("F", a.step, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"stage {s}: {a} (action #{i}) comes before its forward")
        units = {(step, mb) for (_, step, mb, _) in seen}
        for step, mb in units:
            for c in range(v):
                for kind in "FB":
                    if (kind, step, mb, c) not in seen:
                        raise ScheduleError(f"stage {s} never computes {kind}{mb}.{c} (step {step})")
    counts = {len({(a.step, a.microbatch) for a in actions}) for actions in schedule}
    if len(counts) > 1:
        raise ScheduleError(f"stages disagree on the number of micro-batches: {sorted(counts)}")
    return True


def check_schedule(schedule):
    """Prove the schedule deadlock-free and causally sound by running it (raises ScheduleError)."""
    simulate(schedule)
    return True


def formula_bubble_fraction(name, p, m, v=1):
    """The literature's bubble: (p-1)/p for naive, (p-1)/(v·m + p - 1) for the pipelined ones."""
    if name == "naive":
        return (p - 1) / p
    return (p - 1) / (v * m + p - 1)


def format_schedule(schedule):
    """The schedule as text, one row per stage (what ``print`` of a schedule should look like)."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in actions) for s, actions in enumerate(schedule))

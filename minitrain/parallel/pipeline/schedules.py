"""Pipeline schedules as pure data (checked and simulated by simulator.py).

A schedule is, for each stage (rank) s of a pipeline of p stages, the ordered list of what that
stage computes: Action("F", microbatch, chunk) (forward), Action("B", ...) (backward) and,
in zero-bubble schedules, Action("W", ...): there B computes only the input gradient and W the
weight gradient (Qi et al. 2024); elsewhere B is the whole backward. The model is cut into p·v
*virtual stages*; chunk c of stage s is virtual stage c·p + s (Narayanan et al. 2021's loop), or,
in the V-shaped zbv, s for chunk 0 and 2p-1-s for chunk 1 (Action.virtual says so). The
communication is spelled out on each action: recv_from / send_to (stage indices, None at
the ends or for W, which neither receives nor sends).

* naive: one micro-batch at a time through the whole pipeline; bubble (p-1)/p.
* gpipe (Huang et al. 2019): all m forwards, then all m backwards; m micro-batches in flight.
* 1f1b (PipeDream-Flush, Narayanan et al. 2021): p-s-1 warm-up forwards, then one forward /
  one backward alternating, then the remaining backwards; GPipe's bubble, min(p-s, m) in flight.
* interleaved_1f1b (Narayanan et al. 2021, Megatron-LM): v chunks per stage, bubble cut by v.
* zb_h1 (Qi et al. 2024, sec. 2.1): 1F1B with B split from W; stage s runs W(i) after B(i+s),
  so every stage keeps p micro-batches in flight (1F1B's peak, on stage 0) and the late Ws fill the
  drain: idle (p-1)(F+B-W) per stage instead of 1F1B's (p-1)(F+B+W), a third when F = B = W.
* zbv (Qi et al. 2024, sec. 6): two chunks per stage in a V (rank 0 holds the first and the
  last virtual stage); 1F1B's peak memory, less idle still.
* pipedream_2bw (Narayanan et al. 2021): 1F1B with no flush between steps batches.

With costs f, b per chunk GPipe, 1F1B and interleaved take (v·m + p - 1)(f + b): the bubble
fraction is (p-1)/(v·m + p - 1).
"""
from dataclasses import dataclass

from ...backend import is_int


@dataclass(frozen=True)
class Action:
    kind: str                 # "F" forward, "B" backward (input gradient when W is split off), "W"
    microbatch: int
    chunk: int = 0
    recv_from: int = None     # stage index the input (F) or the gradient (B) comes from
    send_to: int = None       # stage index the output (F) or the input gradient (B) goes to
    step: int = 0             # pipedream_2bw: the batch this micro-batch belongs to
    virtual: int = None       # the virtual stage; None: chunk·p + stage (the interleaved loop)

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A schedule that would deadlock, or breaks happens-before."""


def virtual_stage(action, stage, p):
    """The virtual stage (model part) an action of stage computes."""
    return action.chunk * p + stage if action.virtual is None else action.virtual


def _rank_of(virtual, p, v_shape):
    if v_shape:
        return virtual if virtual < p else 2 * p - 1 - virtual
    return virtual % p


def _with_comm(kind, mb, chunk, stage, p, v, step=0, v_shape=False):
    virtual = (stage if chunk == 0 else 2 * p - 1 - stage) if v_shape else chunk * p + stage
    prev_stage = _rank_of(virtual - 1, p, v_shape) if virtual > 0 else None
    next_stage = _rank_of(virtual + 1, p, v_shape) if virtual < p * v - 1 else None
    tag = virtual if v_shape else None
    if kind == "F":
        return Action("F", mb, chunk, prev_stage, next_stage, step, tag)
    if kind == "B":
        return Action("B", mb, chunk, next_stage, prev_stage, step, tag)
    return Action("W", mb, chunk, None, None, step, tag)


def naive(p, m):
    """Micro-batch by micro-batch: forward through all stages, then backward, then the next one."""
    return [[a for mb in range(m) for a in (_with_comm("F", mb, 0, s, p, 1), _with_comm("B", mb, 0, s, p, 1))]
            for s in range(p)]


def gpipe(p, m):
    """All forwards, then all backwards (the last micro-batch first, as it finishes last)."""
    return [[_with_comm("F", mb, 0, s, p, 1) for mb in range(m)] +
            [_with_comm("B", mb, 0, s, p, 1) for mb in reversed(range(m))] for s in range(p)]


def _warmup_steady_cooldown(fwd, bwd, warmup):
    """warmup forwards, then one forward / one backward alternating, then the last backwards."""
    actions = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        actions += [fwd[warmup + i], bwd[i]]
    return actions + bwd[len(bwd) - warmup:]


def one_f_one_b(p, m, steps=1):
    """PipeDream-Flush: warm up with p-s-1 forwards, alternate, drain. steps > 1 chains
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


def zb_h1(p, m):
    """ZB-H1: 1F1B's forwards and (input-gradient) backwards; stage s computes W(i) right after
    B(i + s), and the Ws still owed at the end fill the drain."""
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [_with_comm("F", i, 0, s, p, 1) for i in range(warmup)]
        weights_done = 0
        for i in range(m):
            if warmup + i < m:
                actions.append(_with_comm("F", warmup + i, 0, s, p, 1))
            actions.append(_with_comm("B", i, 0, s, p, 1))
            if i >= s:
                actions.append(_with_comm("W", weights_done, 0, s, p, 1))
                weights_done += 1
        schedule.append(actions + [_with_comm("W", i, 0, s, p, 1) for i in range(weights_done, m)])
    return schedule


def zbv(p, m):
    """ZB-V (the paper's Figure 8 pattern, as torch.distributed.pipelining's ScheduleZBVZeroBubble
    writes it): chunk 0 goes down the ranks, chunk 1 back up. Built for max(m, 2p-1) micro-batches,
    then the ones beyond m are dropped (the order of the rest stays valid)."""
    n = max(m, 2 * p - 1)
    return [_zbv_stage(s, p, m, n) for s in range(p)]


def _zbv_stage(s, p, m, n):
    actions, count = [], {}

    def add(kinds, chunk):
        for kind in kinds:
            i = count.get((kind, chunk), 0)
            count[kind, chunk] = i + 1
            if i < m:
                actions.append(_with_comm(kind, i, chunk, s, p, 2, v_shape=True))

    def counted(kind, chunk):
        return count.get((kind, chunk), 0)

    add("F" * (2 * (p - s) - 1), 0)                # warm-up: chunk 0 fills the V's left arm
    for _ in range(s):
        add("F", 1)
        add("F", 0)
    for _ in range(p - s):                         # the V's bottom: chunk 1 turns back at once
        add("FBW", 1)
    while counted("F", 1) < counted("F", 0) or counted("F", 0) < n:    # steady: F B W on both chunks
        if counted("F", 0) < n:
            add("F", 0)
        add("BW", 0)
        add("FBW", 1)
    for _ in range(s):                             # drain: Bs first, the Ws fill what is left
        add("B", 0)
        add("B", 1)
    for _ in range(p - s):
        add("BW", 0)
    add("W" * (counted("B", 1) - counted("W", 1)), 1)
    add("W" * (counted("B", 0) - counted("W", 0)), 0)
    return actions


NAMES = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "pipedream_2bw")
SPLIT_BACKWARD = ("zb_h1", "zbv")             # schedules with W actions


def microbatch_sizes(rows, m):
    """The rows of each of m micro-batches of a batch of ``rows``, as the runtime cuts it: the first rows % m
    one row more (with rows < m, some empty)."""
    return [rows // m + (1 if i < rows % m else 0) for i in range(m)]


def default_chunks(name, chunks=None):
    """Model chunks per stage: chunks for interleaved_1f1b (default 1), 2 for zbv, else 1."""
    if chunks is not None and not (is_int(chunks) and chunks >= 1):
        raise ValueError(f"{name}: chunks must be an integer >= 1, got {chunks!r}")
    if name == "zbv":
        if chunks not in (None, 2):
            raise ValueError(f"zbv is a V of exactly 2 chunks per stage, got chunks={chunks}")
        return 2
    if chunks not in (None, 1) and name != "interleaved_1f1b":
        raise ValueError(f"chunks={chunks} needs the interleaved_1f1b schedule, not {name!r}")
    return 1 if chunks is None else chunks


def get_schedule(name, num_stages, num_microbatches, chunks=None, steps=1):
    """Per stage, the ordered list of Actions. chunks only for interleaved_1f1b (zbv has 2);
    steps (batches chained without a flush) only for pipedream_2bw."""
    p, m = num_stages, num_microbatches
    if not all(is_int(n) and n >= 1 for n in (p, m)):
        raise ValueError(f"a pipeline needs an integer >= 1 of stages and of micro-batches (num_microbatches), got "
                         f"{p!r} and {m!r}")
    v = default_chunks(name, chunks)
    makers = {"naive": lambda: naive(p, m), "gpipe": lambda: gpipe(p, m), "1f1b": lambda: one_f_one_b(p, m),
              "interleaved_1f1b": lambda: interleaved_1f1b(p, m, v), "zb_h1": lambda: zb_h1(p, m),
              "zbv": lambda: zbv(p, m), "pipedream_2bw": lambda: one_f_one_b(p, m, steps)}
    if name not in makers:
        raise ValueError(f"unknown schedule {name!r}: expected one of {NAMES}")
    return makers[name]()


def num_chunks(schedule):
    return 1 + max(a.chunk for actions in schedule for a in actions)


def splits_backward(schedule):
    """True when backward is split into B (input gradient) and W (weight gradient) actions."""
    return any(a.kind == "W" for actions in schedule for a in actions)


def placement(schedule):
    """For each virtual stage, the (stage, chunk) that computes it, read off the actions."""
    p = len(schedule)
    where = {}
    for s, actions in enumerate(schedule):
        for a in actions:
            where[virtual_stage(a, s, p)] = (s, a.chunk)
    return [where[k] for k in sorted(where)]


def format_schedule(schedule):
    """The schedule as text, one row per stage (what print of a schedule should look like)."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in actions) for s, actions in enumerate(schedule))

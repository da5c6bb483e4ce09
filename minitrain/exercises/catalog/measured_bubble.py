"""Grader: the measured bubble of one pipeline step (measure.py's definition), from each rank's entry
and exit and its actions' compute, receive and send spans. Hand-made steps with known answers (two
ranks entering and leaving together, a rank entering late or early, a rank leaving early, uneven busy
time with W); the simulator's unit-cost GPipe and 1F1B == (p-1)/(m+p-1); the records of real 2-stage
GPipe, 1F1B and ZB-H1 steps on ThreadWorld == minitrain's split_idle (1e-12). Slips named."""
import numpy as np

from ..comparing import to_learner
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "the measured bubble: each rank's time outside its own F, B, W over the pipeline's wall, the mean over ranks"
ORDER = 136
KIND = "implement"
NOTEBOOK = "05_pipeline"
DEFINES = "bubble_fraction"

STUB = '''"""Exercise measured_bubble: the formula (p-1)/(m+p-1) is the bubble of an idealised pipeline.
minitrain's runtime measures the real one: it stamps every step, on every rank, with the time the
rank entered and left it, and for each action the start and end of its compute (F, B or W), of
the receive that waited for its input and of the send that posted its result. Write the measurement
of one step, as minitrain's measure.py defines it:

  bubble_fraction(step_start, step_end, actions) -> float

  - step_start[r], step_end[r]: when rank r entered and left the step (seconds, one clock for
    every rank); rank 0 hosts the first stage;
  - actions[r]: rank r's actions in the order it ran them, each a dict
      {"kind": "F" | "B" | "W", "compute": (start, end), "receive": (start, end) or None,
       "send": (start, end) or None}
    (None where the action has no receive, or no send).

Definition:
  - the step's wall time is the pipeline's, the same for every rank: from the first stage entering
    the step (nothing happens before it: every other stage waits for its activations) to the last
    rank leaving it;
  - a rank is busy only while it computes its own F, B and W; waiting in a receive, posting a send
    and everything between the computes is bubble;
  - the rank's bubble is 1 - busy / wall; the step's is the mean of the ranks' bubbles.
Leave the arguments as they are; return one number. The stamps are perf_counter seconds (large
numbers): subtract each span's start from its end before adding them up.

The test to pass:
  - hand-made steps with known answers: two ranks entering and leaving together, a rank entering
    late (or before the first stage), a rank leaving early, four ranks busy unevenly, with W;
  - every F and B of unit cost placed as minitrain's simulator places them: GPipe at p = 2, 4 and
    m = 4, 8, and 1F1B, give exactly (p-1)/(m+p-1);
  - the records of real 2-stage GPipe, 1F1B and ZB-H1 steps (PipelineParallel on ThreadWorld,
    3 steps each): every step == minitrain's measure.split_idle (1e-12).

Check it:  python -m minitrain.exercises check measured_bubble mine.py
Stuck?     python -m minitrain.exercises hint measured_bubble
"""


def bubble_fraction(step_start, step_end, actions):
    raise NotImplementedError("bubble_fraction: 1 - busy / wall per rank, then the mean over ranks")
'''

HINTS = (
    "One wall for every rank. It starts when rank 0 (the first stage) enters the step: a rank that entered "
    "later was still busy with the previous step (its optimizer), one that entered earlier waited for nothing "
    "of this step. It ends when the last rank leaves: max(step_end). A rank that left early idled until the "
    "others were done; that is its bubble too.",
    "Busy is compute alone: for each action end - start of its compute span, F, B and W alike. A receive's "
    "span is mostly waiting for the neighbour (the bubble itself), a send's is posting a message: neither is "
    "work. Each rank then has 1 - busy / wall; the step's bubble is their mean, not the worst rank's, and not "
    "the busy time of every rank over one wall.",
    "wall = max(step_end) - step_start[0]; busy_r = sum(a['compute'][1] - a['compute'][0] for a in "
    "actions[r]); return sum(1 - busy_r / wall over r) / len(actions).",
)


def _action(kind, compute, receive=None, send=None):
    return {"kind": kind, "compute": compute, "receive": receive, "send": send}


def _busy(actions, parts=("compute",), kinds="FBW"):
    return [sum(x[part][1] - x[part][0] for x in acts if x["kind"] in kinds for part in parts if x[part] is not None)
            for acts in actions]


def _mean_idle(busy, w0, w1):
    return float(np.mean([1 - b / (e - s) for b, s, e in zip(busy, w0, w1)]))


def _slips(start, end, actions):
    """(why, what that slip returns) for the usual slips, on one step."""
    p, first, last = len(actions), start[0], max(end)
    busy = _busy(actions)
    wall = last - first
    idle = [1 - b / wall for b in busy]
    every = lambda t: [t] * p                    # noqa: E731
    spread = [max(x["compute"][1] for x in a) - min(x["compute"][0] for x in a) for a in actions]
    return [
        ("the wall per rank, from its own entry to its own exit: the wall is the pipeline's, the same for every rank, "
         "from the first stage's entry to the last rank's exit", _mean_idle(busy, start, end)),
        ("the wall from each rank's own entry: it starts when the first stage (rank 0) enters, for every rank",
         _mean_idle(busy, start, every(last))),
        ("the wall to each rank's own exit: it ends when the last rank leaves, for every rank (one that left early "
         "idled until then)", _mean_idle(busy, every(first), end)),
        ("the wall from the earliest entry, min(step_start): it starts when the first stage (rank 0) enters; a rank "
         "that entered before it waited for nothing of this step", _mean_idle(busy, every(min(start)), every(last))),
        ("the wall from the last rank to enter: it starts when the first stage (rank 0) enters",
         _mean_idle(busy, every(max(start)), every(last))),
        ("the wall from the first compute: it starts when the first stage (rank 0) enters the step, step_start[0]",
         _mean_idle(busy, every(min(x["compute"][0] for a in actions for x in a)), every(last))),
        ("the wall to rank 0's exit: it ends when the last rank leaves, max(step_end)", _mean_idle(busy, every(first), every(end[0]))),
        ("the wall to the last stage's exit: it ends when the last rank leaves, max(step_end), whichever rank that is",
         _mean_idle(busy, every(first), every(end[-1]))),
        ("the wall to the mean exit: it ends when the last rank leaves, max(step_end)",
         _mean_idle(busy, every(first), every(float(np.mean(end))))),
        ("the receive spans counted as busy: a receive waits for the neighbour's message, which is the bubble itself",
         _mean_idle(_busy(actions, ("compute", "receive")), every(first), every(last))),
        ("the send spans counted as busy: posting a message is not the stage's work", _mean_idle(
            _busy(actions, ("compute", "send")), every(first), every(last))),
        ("the receive and send spans counted as busy: only the computes are work",
         _mean_idle(_busy(actions, ("compute", "receive", "send")), every(first), every(last))),
        ("W left out: a zero-bubble schedule's W computes the weight gradients, work like F and B",
         _mean_idle(_busy(actions, kinds="FB"), every(first), every(last))),
        ("busy from the rank's first compute to its last: the waits between them are bubble",
         _mean_idle(spread, every(first), every(last))),
        ("the largest rank's bubble: the step's is the mean over ranks", max(idle)),
        ("the smallest rank's bubble: the step's is the mean over ranks", min(idle)),
        ("rank 0's bubble alone: the step's is the mean over ranks", idle[0]),
        ("the last rank's bubble alone: the step's is the mean over ranks", idle[-1]),
        ("1 - (busy summed over ranks) / wall: every rank has the whole wall, so divide by p x wall (the mean over "
         "ranks)", 1 - sum(busy) / wall),
        ("the busy share, not the bubble: the bubble is 1 - busy / wall", 1 - float(np.mean(idle))),
        ("the spans summed before subtracting (sum of ends - sum of starts): the stamps are large perf_counter "
         "seconds and their sums lose a span's digits; subtract each span's start from its end first",
         _mean_idle([sum(x["compute"][1] for x in a) - sum(x["compute"][0] for x in a) for a in actions],
                    every(first), every(last)))]


def _expect(impl, start, end, actions, want, what, rtol=1e-12):
    """The learner's bubble of this step == want, or a Mismatch naming the slip that explains it."""
    given = (list(start), list(end), [[dict(x) for x in a] for a in actions])
    got = impl(*given)
    if given != (list(start), list(end), [[dict(x) for x in a] for a in actions]):
        raise Mismatch(f"{what}: your code changed its arguments; leave them as they are (measure only)")
    if isinstance(got, (list, tuple, np.ndarray)) and np.size(got) == len(actions) > 1:
        raise Mismatch(f"{what}: returned one value per rank ({np.asarray(got).tolist()}); return the step's "
                       f"bubble, their mean")
    try:
        got = float(got)
    except (TypeError, ValueError):
        raise Mismatch(f"{what}: returned {type(got).__name__} {got!r:.60}; return one number, the step's bubble")
    if abs(got - want) <= rtol * max(1.0, abs(want)):
        return
    said = f"{what}: the bubble is {want:.12g}, yours {got:.12g}"
    slips = [why for why, value in _slips(start, end, actions)
             if abs(value - want) > 1e-12 and abs(got - value) <= 1e-9 * max(1.0, abs(value))]
    raise Mismatch(f"{said}: " + "; or ".join(slips) if slips else said)


def _two_ranks(impl):
    """GPipe, p = 2, m = 2: rank 0 sends after each F and waits for its B's gradients; rank 1 waits for
    its Fs' activations. Busy 5.6 and 5.0 of a 10 s wall: 0.44 and 0.5."""
    ranks = [[_action("F", (0.5, 1.5), send=(1.5, 1.6)), _action("F", (1.7, 2.7), send=(2.7, 2.8)),
              _action("B", (6.0, 7.8), receive=(2.9, 6.0)), _action("B", (8.0, 9.8), receive=(7.9, 8.0))],
             [_action("F", (1.7, 2.7), receive=(0.1, 1.7)), _action("F", (2.9, 3.9), receive=(2.8, 2.9)),
              _action("B", (4.0, 5.5), send=(5.5, 5.6)), _action("B", (5.6, 7.1), send=(7.1, 7.2))]]
    _expect(impl, [0.0, 0.0], [10.0, 10.0], ranks, 0.47, "GPipe, 2 ranks, both in the step from 0 to 10")


def _entries(impl):
    """The same work: rank 1 enters at 1 (its optimizer), then at -0.5 (before rank 0, which enters at 0.5)."""
    ranks = [[_action("F", (1.0, 2.0), send=(2.0, 2.1)), _action("B", (5.0, 7.0), receive=(2.1, 5.0))],
             [_action("F", (2.5, 3.5), receive=(1.2, 2.5)), _action("B", (3.5, 5.5), send=(5.5, 5.6))]]
    _expect(impl, [0.0, 1.0], [8.0, 8.0], ranks, 1 - 3 / 8, "rank 0 enters at 0, rank 1 late at 1, both leave at 8")
    _expect(impl, [0.5, -0.5], [8.5, 8.5], ranks, 1 - 3 / 8,
            "rank 1 enters at -0.5, before the first stage (rank 0, at 0.5); both leave at 8.5")


def _exits(impl):
    """Three ranks enter at 0 and leave at 9, 9.6 and 9.3: the wall is 9.6 for every rank."""
    ranks = [[_action("F", (0.2, 1.2), send=(1.2, 1.3)), _action("B", (6.0, 8.0), receive=(1.3, 6.0))],
             [_action("F", (1.4, 2.4), receive=(0.1, 1.4), send=(2.4, 2.5)),
              _action("B", (4.5, 6.5), receive=(2.5, 4.5), send=(6.5, 6.6))],
             [_action("F", (2.6, 3.6), receive=(0.1, 2.6)), _action("B", (3.6, 5.6), send=(5.6, 5.7))]]
    _expect(impl, [0.0, 0.0, 0.0], [9.0, 9.6, 9.3], ranks, 1 - 3 / 9.6, "ranks leaving at 9, 9.6 and 9.3")


def _uneven(impl):
    """Four ranks of a ZB-like step, busy 4.5, 6.5, 2 and 3 (W included) of a 10 s wall: mean bubble 0.6."""
    busy = [(1.5, 2.0, 1.0), (2.0, 3.0, 1.5), (0.5, 1.0, 0.5), (1.0, 1.5, 0.5)]
    ranks = []
    for r, (f, b, w) in enumerate(busy):
        t = 0.5 * r
        ranks.append([_action("F", (t, t + f), receive=None if r == 0 else (0.0, t), send=(t + f, t + f + 0.1)),
                      _action("B", (5.0, 5.0 + b), receive=(t + f + 0.1, 5.0), send=None if r == 0 else (5 + b, 5.2 + b)),
                      _action("W", (5.3 + b, 5.3 + b + w))])
    _expect(impl, [0.0] * 4, [10.0] * 4, ranks, 0.6, "4 ranks busy 4.5, 6.5, 2 and 3 s (W included) of a 10 s step")


def _simulated(impl):
    """Unit-cost F and B as the simulator places them: the formula, exactly."""
    from ...parallel.pipeline import get_schedule, simulate
    for name, p, m in [("gpipe", 2, 4), ("gpipe", 2, 8), ("gpipe", 4, 4), ("gpipe", 4, 8), ("1f1b", 4, 8)]:
        sim = simulate(get_schedule(name, p, m), 1.0, 1.0)
        ranks = []
        for s, line in enumerate(sim["timeline"]):
            clock, acts = 0.0, []
            for action, b, e in line:
                acts.append(_action(action.kind, (b, e), receive=(clock, b) if action.recv_from not in (None, s) else None,
                                    send=(e, e) if action.send_to not in (None, s) else None))
                clock = e
            ranks.append(acts)
        want = (p - 1) / (m + p - 1)
        assert abs(sim["bubble_fraction"] - want) < 1e-12      # the grader's own premise
        total = sim["total_time"]
        _expect(impl, [0.0] * p, [total] * p, ranks, want,
                f"{name}, p = {p}, m = {m}, unit F and B as the simulator places them (the formula (p-1)/(m+p-1))")


def _records(name):
    """(rows, schedule) of 3 traced steps of a 2-stage PipelineParallel (float64 MLP, m = 4)."""
    def rank(comm):
        from ... import manual_seed, nn, trace
        from ...nn import functional as F
        from ...parallel.pipeline import PipelineParallel
        manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).to(np.float64)
        pipe = PipelineParallel(model, comm, name, num_microbatches=4)
        trace.enable(rank=comm.rank)
        rng = np.random.default_rng(0)
        try:
            for _ in range(3):
                pipe.train_step(to_learner(rng.standard_normal((8, 5))), to_learner(rng.standard_normal((8, 3))),
                                F.mse_loss)
        finally:
            trace.disable()
        pipe.stamps.resolve_device_times()
        return np.array(pipe.step_records), pipe.schedule
    out = run_ranks(2, rank)
    return np.stack([rows for rows, _ in out]), out[0][1]


def _real(impl):
    from ...parallel.pipeline.measure import action_slots, split_idle
    for name in ("gpipe", "1f1b", "zb_h1"):
        rows, schedule = _records(name)
        _, bubble, _ = split_idle(rows, schedule, first_rank=0)
        slots = action_slots(rows)
        for t in range(rows.shape[1]):
            ranks = [[_action(a.kind, tuple(slots[r, t, i, 0:2].tolist()),
                              None if np.isnan(slots[r, t, i, 2]) else tuple(slots[r, t, i, 2:4].tolist()),
                              None if np.isnan(slots[r, t, i, 4]) else tuple(slots[r, t, i, 4:6].tolist()))
                      for i, a in enumerate(schedule[r])] for r in range(len(schedule))]
            _expect(impl, rows[:, t, 0].tolist(), rows[:, t, 1].tolist(), ranks, float(bubble[:, t].mean()),
                    f"{name}, 2 ranks, m = 4, real step {t} (minitrain's split_idle)")


def checks():
    return [Check("GPipe on 2 ranks entering and leaving together: 1 - busy / wall per rank, their mean", _two_ranks, 2),
            Check("a rank entering late, or before the first stage: the wall starts when rank 0 enters", _entries, 1),
            Check("a rank leaving early: the wall ends when the last rank leaves", _exits, 1),
            Check("4 ranks busy unevenly, W included: the mean over ranks of each rank's bubble", _uneven, 2),
            Check("unit F and B as the simulator places them: GPipe and 1F1B == (p-1)/(m+p-1)", _simulated, 3),
            Check("real GPipe, 1F1B and ZB-H1 steps on 2 ranks: every step == minitrain's split_idle", _real, 3)]


def reference():
    """minitrain's measure.split_idle on the step, laid out as the runtime's records (HEAD, then SLOT per
    action; NaN for a missing span). The bubble needs no schedule: its pairing of sends only splits the causes."""
    from ...parallel.pipeline.measure import HEAD, SLOT, split_idle

    def bubble_fraction(step_start, step_end, actions):
        p, n = len(actions), max(len(a) for a in actions)
        slots = np.full((p, 1, n, len(SLOT)), np.nan)
        for r, acts in enumerate(actions):
            for i, x in enumerate(acts):
                slots[r, 0, i] = [*x["compute"], *(x["receive"] or (np.nan,) * 2), *(x["send"] or (np.nan,) * 2)]
        head = np.zeros((p, 1, len(HEAD)))
        head[:, 0, 0], head[:, 0, 1] = step_start, step_end
        rows = np.concatenate([head, slots.reshape(p, 1, -1)], axis=2)
        _, bubble, _ = split_idle(rows, [[] for _ in range(p)], first_rank=0)
        return float(bubble[:, 0].mean())
    return bubble_fraction

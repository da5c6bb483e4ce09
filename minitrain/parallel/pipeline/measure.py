"""The measured bubble, and where the rest of the step went.

Definition (the one the formula counts): in each step, per rank, the time not spent in that
stage's own forward / backward / weight-gradient work (F, B, W spans), over the step's wall time.
The step's wall time is the pipeline's: from the first stage starting the step (nothing can
happen before that: every other stage waits for its activations) to the last rank finishing it.
The reported bubble is the mean over ranks, averaged over the steps after the first (the first
allocates every buffer and warms the caches; it is reported on its own).

The idle time of a rank is split, exactly, into causes: waiting for a message or after its work
is done (``waiting``: the schedule's own bubble lives here), posting sends (``send``), Python
between the spans (``python_overhead``: slicing micro-batches, wrapping tensors, bookkeeping), the
end of the step (``end_of_step``: waiting for sends, the loss broadcast, a dp all-reduce) and a
late start (``late_start``: still in the previous step's optimizer). ``residual_by_cause`` says,
as fractions of the step, what makes the measured bubble differ from the formula: the schedule
run by the simulator with each stage's measured F, B, W costs accounts for the ``stage_imbalance``
(simulated minus formula); waiting beyond the simulated bubble (``waiting_beyond_schedule``:
message latency, neighbours delayed by their own overheads); and every overhead above. The causes
sum to measured minus formula.
"""
import numpy as np

from .schedules import SPLIT_BACKWARD, formula_bubble_fraction, simulate

_FIELDS = ("start", "end", "last", "busy", "recv", "send")
_OPS = "FBW"


def step_record(events, n_virtual):
    """This rank's time split of one step, from its trace events: a flat float64 array of the
    ``_FIELDS``, then per virtual stage and op (F, B, W) the summed time and the count."""
    step = next(e for e in events if e["name"] == "pipeline step")
    row = np.zeros(len(_FIELDS) + 2 * 3 * n_virtual)
    ops = np.zeros((2, n_virtual, 3))
    last = step["start"]
    busy = recv = send = 0.0
    for e in events:
        args = e.get("args") or {}
        duration = e["end"] - e["start"]
        if "op" in args:
            busy += duration
            k = args.get("virtual", args.get("chunk", 0))
            ops[0, k, _OPS.index(args["op"])] += duration
            ops[1, k, _OPS.index(args["op"])] += 1
        elif args.get("wait") == "recv":
            recv += duration
        elif args.get("wait") == "send":
            send += duration
        else:
            continue
        last = max(last, e["end"])
    row[:len(_FIELDS)] = step["start"], step["end"], last, busy, recv, send
    row[len(_FIELDS):] = ops.ravel()
    return row


def _gather(pipe, records):
    """(ranks, steps, fields): every rank's records of the pipeline's steps."""
    from ...comm import ring_all_gather
    mine = np.asarray(records, np.float64)
    counts = ring_all_gather(pipe.comm, np.array([float(len(records))]), total=pipe.p)
    if len(set(counts.tolist())) != 1:
        raise RuntimeError(f"[rank {pipe.rank}] the pipeline's ranks traced different numbers of steps: "
                           f"{counts.astype(int).tolist()}")
    allrows = ring_all_gather(pipe.comm, mine.ravel(), total=mine.size * pipe.p)
    return allrows.reshape(pipe.p, *mine.shape)


def split_idle(rows, first_rank):
    """Per step and rank: the step's wall time, the bubble, and the idle time split by cause
    (each a fraction of the step). ``rows``: (ranks, steps, fields)."""
    start, end, last, busy, recv, send = (rows[:, :, i] for i in range(len(_FIELDS)))
    w0 = start[first_rank]                                # the first stage starts the step
    w1 = end.max(axis=0)
    wall = w1 - w0
    begin = np.maximum(start, w0)                         # a rank that started early waits until w0
    recv_in = np.maximum(recv - (begin - start), 0.0)     # ... in its first receive: not in the step
    causes = {"waiting": recv_in + (w1 - end), "send": send,
              "python_overhead": np.maximum(last - begin - busy - recv_in - send, 0.0),
              "end_of_step": end - last, "late_start": begin - w0}
    return wall, 1 - busy / wall, {k: v / wall for k, v in causes.items()}


def stage_costs(rows, n_virtual, steps):
    """Mean F, B, W time per virtual stage over ``steps`` (arrays of length n_virtual)."""
    ops = rows[:, steps, len(_FIELDS):].reshape(rows.shape[0], len(steps), 2, n_virtual, 3)
    total, count = ops[:, :, 0].sum(axis=(0, 1)), ops[:, :, 1].sum(axis=(0, 1))
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    return mean[:, 0], mean[:, 1], mean[:, 2]


def summarize(pipe, skip_first=True, last_only=False):
    """The job's ``"pipeline"`` figures from every traced step (a collective over ``pipe.comm``)."""
    if not pipe.step_records:
        raise RuntimeError(f"[rank {pipe.rank}] no traced pipeline step: call trace.enable() before train_step")
    rows = _gather(pipe, pipe.step_records)
    n_steps = rows.shape[1]
    steps = [n_steps - 1] if last_only else (list(range(1, n_steps)) if skip_first and n_steps > 1 else
                                             list(range(n_steps)))
    wall, bubble, causes = split_idle(rows, pipe.where[0][0])
    n_virtual = len(pipe.where)
    f, b, w = stage_costs(rows, n_virtual, steps)
    split = pipe.schedule_name in SPLIT_BACKWARD
    simulated = simulate(pipe.schedule, f, b, w)
    if split:              # no closed form: the simulator at the stages' mean F, B, W
        formula = formula_bubble_fraction(pipe.schedule_name, pipe.p, pipe.m, pipe.v, f.mean(), b.mean(), w.mean())
    else:
        formula = formula_bubble_fraction(pipe.schedule_name, pipe.p, pipe.m, pipe.v)
    measured = float(bubble[:, steps].mean())
    mean_cause = {k: float(v[:, steps].mean()) for k, v in causes.items()}
    residual = {"stage_imbalance": simulated["bubble_fraction"] - formula,
                "waiting_beyond_schedule": mean_cause.pop("waiting") - simulated["bubble_fraction"]}
    residual.update(mean_cause)
    return {"measured_bubble_fraction": measured,
            "measured_bubble_fraction_per_rank": bubble[:, steps].mean(axis=1).tolist(),
            "measured_bubble_fraction_per_step": bubble.mean(axis=0).tolist(),
            "measured_bubble_fraction_spread": [float(np.min(bubble[:, steps].mean(axis=0))),
                                                float(np.max(bubble[:, steps].mean(axis=0)))],
            "first_step_bubble_fraction": float(bubble[:, 0].mean()),
            "formula_bubble_fraction": float(formula),
            "simulated_bubble_fraction": float(simulated["bubble_fraction"]),
            "residual_by_cause": {k: float(v) for k, v in residual.items()},
            "steps_measured": len(steps),
            "step_time_s": float(np.median(wall[steps])),
            "simulated_step_time_s": float(simulated["total_time"]),
            "stage_seconds": {"F": f.tolist(), "B": b.tolist(), "W": w.tolist()}}

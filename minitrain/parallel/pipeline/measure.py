"""The measured bubble, and where the rest of the step went.

Definition (what the formula counts): in each step, per rank, the time not spent in that stage's
own forward / backward / weight-gradient work (its F, B, W spans), over the step's wall time. The
step's wall time is the pipeline's: from the first stage entering the step (nothing happens
before: every other stage waits for its activations) to the last rank leaving it (the step ends
with an all-reduce of the loss, so all leave together). Reported: the mean over ranks, averaged
over the steps after the first (the first allocates the buffers and learns the message shapes;
it is reported on its own) and, given the job's batch size, over its full batches alone: an epoch's
short last batch cuts smaller micro-batches, whose fixed costs weigh more (its step figures leave
it out too).

Every rank's idle time is split, exactly, into causes, from the runtime's timestamps of each
action's compute, receive and send, matching each receive with the neighbour's send (one clock
for all processes of a host):
waiting (for a message not yet sent, for the others at the end of the step, after its last
work: the schedule's own bubble lives here), message_transfer (from the send being posted to
the receive returning: the copy into the receive buffer and the waiter's wake-up), send
(posting sends), python_overhead (between the spans: slicing micro-batches, wrapping tensors,
bookkeeping), dp_all_reduce (2D only) and late_start (the rank entered the step after the
first stage: still in the previous step's optimizer). The simulation each step is held to runs
the schedule with that step's measured actions, each at its own measured duration, and the
measured costs of a message (LogP's, Culler et al. 1993: latency, the sender's and the receiver's
overhead). residual_by_cause is measured minus formula, split: stage_imbalance (the schedule
simulated with each stage's mean F, B, W and free messages, minus the formula), compute_spread
(each action at its own duration instead of its stage's mean: the spread of compute times, which a
pipeline waits for), message_latency and message_overhead (what the message's measured latency,
then its overheads, add to that simulation), then, beyond it, waiting_beyond_schedule (neighbours
delayed by their own overheads), message_transfer and send (measured minus simulated), and every
overhead above. The causes add up to measured - formula.
A message's measured cost (message_costs): the latency, the median over the receives that were
waiting when the send was posted of the time from the send posted to the receive returning (the
copy, the waiter's wake-up); the send overhead, the mean time posting a send; the receive overhead,
the mean time taking a message that was already there (posting the next receive ahead included).
"""
import numpy as np

from .schedules import SPLIT_BACKWARD, virtual_stage
from .simulator import formula_bubble_fraction, simulate

# A step's record (runtime.py writes one per traced step and rank): the step's start and end, the
# time waiting at its end (sends, loss all-reduce), the dp all-reduce, then per action of the rank's
# schedule the start and end of its compute, its receive and its send (NaN where it has none).
HEAD = ("start", "end", "end_wait", "dp")
SLOT = ("c0", "c1", "r0", "r1", "s0", "s1")


def action_slots(rows):
    """rows (ranks, steps, fields) as (ranks, steps, actions, SLOT): each action's stamps."""
    return rows[:, :, len(HEAD):].reshape(rows.shape[0], rows.shape[1], -1, len(SLOT))


def senders(schedule):
    """For each (rank, action index) that receives from another rank: (sender rank, its action index)."""
    p = len(schedule)
    index = {(s, a.kind, a.step, a.microbatch, virtual_stage(a, s, p)): i
             for s in range(p) for i, a in enumerate(schedule[s])}
    pairs = {}
    for r in range(p):
        for i, a in enumerate(schedule[r]):
            if a.recv_from is not None and a.recv_from != r:
                k = virtual_stage(a, r, p) + (-1 if a.kind == "F" else 1)
                pairs[r, i] = (a.recv_from, index[a.recv_from, a.kind, a.step, a.microbatch, k])
    return pairs


def split_idle(rows, schedule, first_rank):
    """Per step and rank: the step's wall time, the bubble, and the idle time by cause (fractions
    of the step). rows: (ranks, steps, fields), the records described above."""
    start, end, end_wait, dp = (rows[:, :, i] for i in range(len(HEAD)))
    slots = action_slots(rows)
    c0, c1, r0, r1, s0, s1 = (slots[..., i] for i in range(len(SLOT)))
    w0 = start[first_rank]
    w1 = end.max(axis=0)
    wall = w1 - w0
    begin = np.maximum(start, w0)
    busy = np.nansum(c1 - c0, axis=2)
    wait = np.zeros_like(busy)
    transfer = np.zeros_like(busy)
    for (r, i), (q, j) in senders(schedule).items():
        posted = s1[q, :, j]                               # the sender's isend was posted by then
        duration = r1[r, :, i] - r0[r, :, i]
        waited = np.clip(posted - r0[r, :, i], 0.0, duration)
        early = np.clip(begin[r] - r0[r, :, i], 0.0, duration)       # before the step began on this rank
        wait[r] += np.maximum(waited - early, 0.0)
        transfer[r] += duration - waited - np.maximum(early - waited, 0.0)
    send = np.nansum(s1 - s0, axis=2)
    causes = {"waiting": wait + end_wait + (w1 - end), "message_transfer": transfer, "send": send,
              "dp_all_reduce": dp, "late_start": begin - w0}
    causes["python_overhead"] = wall - busy - sum(causes.values())
    return wall, 1 - busy / wall, {k: v / wall for k, v in causes.items()}


def stage_costs(rows, schedule, steps):
    """Mean F, B, W seconds per virtual stage over steps (arrays of length p·v)."""
    p = len(schedule)
    n_virtual = 1 + max(virtual_stage(a, s, p) for s in range(p) for a in schedule[s])
    total, count = np.zeros((n_virtual, 3)), np.zeros((n_virtual, 3))
    slots = action_slots(rows)[:, steps]
    for s in range(p):
        for i, a in enumerate(schedule[s]):
            k, op = virtual_stage(a, s, p), "FBW".index(a.kind)
            total[k, op] += np.sum(slots[s, :, i, 1] - slots[s, :, i, 0])
            count[k, op] += len(steps)
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    return mean[:, 0], mean[:, 1], mean[:, 2]


def message_costs(rows, schedule, steps):
    """(latency, send overhead, receive overhead) in seconds, as described above (0 where the
    steps had no such message)."""
    slots = action_slots(rows)[:, steps]
    waited, sends, taken = [], [], []
    for (r, i), (q, j) in senders(schedule).items():
        s0, s1, r0, r1 = slots[q, :, j, 4], slots[q, :, j, 5], slots[r, :, i, 2], slots[r, :, i, 3]
        waited += (r1 - s1)[r0 <= s1].tolist()
        sends += (s1 - s0).tolist()
        taken += (r1 - r0)[r0 > s1].tolist()
    return (float(np.median(waited)) if waited else 0.0, float(np.mean(sends)) if sends else 0.0,
            float(np.mean(taken)) if taken else 0.0)


def _simulated_shares(sim, p):
    """The simulation's idle split as split_idle splits a step: send, transfer, the rest waiting."""
    total = p * sim["total_time"]
    send = sum(sim["send_per_stage"]) / total if total else 0.0
    transfer = sum(sim["transfer_per_stage"]) / total if total else 0.0
    return {"send": send, "message_transfer": transfer, "waiting": sim["bubble_fraction"] - send - transfer}


def _per_step(rows, schedule, steps, latency, send_overhead, receive_overhead):
    """Each step simulated with its own actions' measured durations: free messages ("free"), with
    the latency ("latent"), with the overheads too ("simulated", its shares, "total_time": the
    median); means over the steps."""
    slots = action_slots(rows)
    runs = {"free": [], "latent": [], "simulated": [], "send": [], "message_transfer": [], "waiting": [], "time": []}
    for t in steps:
        took = slots[:, t, :, 1] - slots[:, t, :, 0]
        duration = lambda stage, i: float(took[stage, i])          # noqa: E731
        runs["free"].append(simulate(schedule, action_cost=duration)["bubble_fraction"])
        runs["latent"].append(simulate(schedule, message_cost=latency, action_cost=duration)["bubble_fraction"])
        sim = simulate(schedule, message_cost=latency, send_overhead=send_overhead,
                       receive_overhead=receive_overhead, action_cost=duration)
        runs["simulated"].append(sim["bubble_fraction"])
        runs["time"].append(sim["total_time"])
        for k, v in _simulated_shares(sim, len(schedule)).items():
            runs[k].append(v)
    return {**{k: float(np.mean(v)) for k, v in runs.items() if k != "time"}, "total_time": float(np.median(runs["time"]))}


def _gather(pipe, records):
    """(ranks, steps, fields): every rank's records of the pipeline's steps."""
    from ...comm import ring_all_gather
    mine = np.asarray(records, np.float64)
    shapes = ring_all_gather(pipe.comm, np.array(mine.shape, np.float64), total=2 * pipe.p).reshape(pipe.p, 2)
    if len({tuple(row) for row in shapes.tolist()}) != 1:
        raise RuntimeError(f"[rank {pipe.rank}] the pipeline's ranks traced different steps: (steps, fields) "
                           f"per rank {shapes.astype(int).tolist()}")
    return ring_all_gather(pipe.comm, mine.ravel(), total=mine.size * pipe.p).reshape(pipe.p, *mine.shape)


def summarize(pipe, skip_first=True, last_only=False, global_rows=None):
    """The job's "pipeline" figures from every traced step (a collective over pipe.comm); global_rows:
    only the steps of batches that size, where there is one after the first (the same on every rank)."""
    if not pipe.step_records:
        raise RuntimeError(f"[rank {pipe.rank}] no traced pipeline step: call trace.enable() before train_step")
    rows = _gather(pipe, pipe.step_records)
    n_steps = rows.shape[1]
    if last_only:
        steps = [n_steps - 1]
    else:
        steps = list(range(1, n_steps)) if skip_first and n_steps > 1 else list(range(n_steps))
    sized = [i for i in steps if pipe.stamps.batch_rows[i] == global_rows]
    left_out = len(steps) - len(sized) if global_rows is not None and sized else 0
    steps = sized if left_out else steps
    wall, bubble, causes = split_idle(rows, pipe.schedule, pipe.where[0][0])
    f, b, w = stage_costs(rows, pipe.schedule, steps)
    latency, send_overhead, receive_overhead = message_costs(rows, pipe.schedule, steps)
    free = simulate(pipe.schedule, f, b, w)
    mean_costs = simulate(pipe.schedule, f, b, w, message_cost=latency, send_overhead=send_overhead,
                          receive_overhead=receive_overhead)
    actual = _per_step(rows, pipe.schedule, steps, latency, send_overhead, receive_overhead)
    if pipe.schedule_name in SPLIT_BACKWARD:      # no closed form: the simulator at the mean F, B, W
        formula = formula_bubble_fraction(pipe.schedule_name, pipe.p, pipe.m, pipe.v, f.mean(), b.mean(), w.mean())
    else:
        formula = formula_bubble_fraction(pipe.schedule_name, pipe.p, pipe.m, pipe.v)
    per_step = bubble.mean(axis=0)
    mean_cause = {k: float(v[:, steps].mean()) for k, v in causes.items()}
    simulated = actual["simulated"]
    residual = {"stage_imbalance": free["bubble_fraction"] - formula,
                "compute_spread": actual["free"] - free["bubble_fraction"],
                "message_latency": actual["latent"] - actual["free"],
                "message_overhead": simulated - actual["latent"],
                "waiting_beyond_schedule": mean_cause.pop("waiting") - actual["waiting"],
                "message_transfer": mean_cause.pop("message_transfer") - actual["message_transfer"],
                "send": mean_cause.pop("send") - actual["send"]}
    residual.update(mean_cause)
    return {"measured_bubble_fraction": float(per_step[steps].mean()),
            "measured_bubble_fraction_per_rank": bubble[:, steps].mean(axis=1).tolist(),
            "measured_bubble_fraction_per_step": per_step.tolist(),
            "measured_bubble_fraction_spread": [float(per_step[steps].min()), float(per_step[steps].max())],
            "first_step_bubble_fraction": float(per_step[0]),
            "formula_bubble_fraction": float(formula),
            "simulated_bubble_fraction": float(simulated),
            "simulated_bubble_fraction_mean_costs": float(mean_costs["bubble_fraction"]),
            "simulated_bubble_fraction_free_messages": float(free["bubble_fraction"]),
            "message_cost_s": latency,
            "message_send_overhead_s": send_overhead,
            "message_receive_overhead_s": receive_overhead,
            "residual_by_cause": {k: float(v) for k, v in residual.items()},
            "steps_measured": len(steps),
            "steps_left_out": left_out,
            "step_time_s": float(np.median(wall[steps])),
            "simulated_step_time_s": actual["total_time"],
            "stage_seconds": {"F": f.tolist(), "B": b.tolist(), "W": w.tolist()}}

"""What every job reports, in one place so the jobs' loops stay loops (nanoGPT's train.py): the step
watch each step runs inside, the per-rank table of step, compute and communication, the memory table,
the planner's prediction beside the measured step, and the JSON.

Steady state: every time figure is a median over the steps after the first WARMUP_STEPS (which
allocate the optimizer's state and warm the caches), and leaves out the step timer's own reference
work (the anchor it runs between steps: step_timer.py) and an epoch's short last batch. Per rank,
compute + exposed communication is the step, and no column is larger than the step it is part of:
each step's communication is the union of its spans, clipped to the step.
"""
import functools
import json
from contextlib import contextmanager

import numpy as np

from .. import memory, trace
from .step_timer import StepTimer, gather_steps  # noqa: F401  (the jobs import them from here)

MODEL_STATE = ("params", "grads", "optimizer_state")
# the loop's own thread waiting for communication (DDP's buckets, ZeRO's and FSDP's collectives, LocalSGD)
WAITS = ("wait for buckets", "average parameters", "wait for reduce-scatter", "reduce-scatter gradients",
         "all-gather parameters")


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def device_name(code):
    return "cpu" if code < 0 else f"cuda:{int(code)}"


def persistent_memory():
    """Model-state bytes live right now (call it at the optimizer step)."""
    live = memory.snapshot()
    return {c: live[c] for c in MODEL_STATE}


def _covered(spans, lo, hi):
    """Seconds of [lo, hi] that at least one of the (start, end) spans covers."""
    covered, reached = 0.0, lo
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in spans):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered


def step_communication(events):
    """(exposed, total) seconds of one step, from its trace spans (the "step" span among them): exposed, the
    loop's thread waiting for a collective; total, that or a collective running (on any thread, overlapping
    backward), so exposed <= total <= step."""
    step = next(e for e in reversed(events) if e["kind"] == "step")
    waits = [(e["start"], e["end"]) for e in events if e["thread"] == step["thread"] and (
        e["name"] in WAITS or e["name"].startswith("all-gather "))]
    ring = [(e["start"], e["end"]) for e in events if e["kind"] == "comm"
            and e["name"].startswith(("ring_", "recursive_doubling"))]
    return _covered(waits, step["start"], step["end"]), _covered(waits + ring, step["start"], step["end"])


def _name_the_backward(events, first):
    """A step traced through traced() has a "forward" and an "optimizer" span on the loop's thread: the time
    between them (the loss, zero_grad and the backward pass) becomes a "backward" span, for the timeline."""
    step = events[first:]
    thread = step[-1]["thread"] if step else None
    forward = [e for e in step if e["name"] == "forward" and e["thread"] == thread]
    optimizer = [e for e in step if e["name"] == "optimizer" and e["thread"] == thread]
    if forward and optimizer and forward[-1]["end"] <= optimizer[0]["start"]:
        trace.tracer().add("backward", "compute", forward[-1]["end"], optimizer[0]["start"], {})


class StepWatch:
    """``with watch.step(counted): ...``: the step timed (StepTimer) and traced (a "step" span), its
    communication measured from its spans, the model states read off the memory ledger after it, and the
    trace trimmed (keep="last": the last step's spans alone; else the last few thousand). StepWatch(rank)
    turns this rank's tracing on."""

    def __init__(self, rank=None, keep="recent"):
        if rank is not None:                   # else the spans are not recorded, and no communication measured
            trace.enable(rank=rank)
        self.timer = StepTimer()
        self.exposed, self.total = [], []      # seconds per counted step, in the timer's order
        self.persistent, self.host, self.last_step_events = {}, {}, []
        self.keep = keep

    @contextmanager
    def step(self, counted=True):
        events = trace.tracer().events
        if self.keep == "last":
            events.clear()
        first, timed = len(events), len(self.timer.steps)
        with self.timer(counted=counted):
            with trace.span("step", kind="step"):
                yield
        self.persistent, self.host = persistent_memory(), memory.host_snapshot()
        _name_the_backward(events, first)
        self.last_step_events = events[first:]
        if len(self.timer.steps) > timed and self.last_step_events:
            exposed, total = step_communication(self.last_step_events)
            self.exposed.append(exposed)
            self.total.append(total)
        if len(events) > 50_000:
            del events[:-5_000]

    def steady_state(self):
        """How the time figures were taken, for the JSON: the statistic, the steps left out and those measured."""
        n = len(self.timer.steps)
        keep = self.timer.steady(n)
        return {"statistic": "median", "skipped_first_steps": keep.start, "steps_measured": n - keep.start,
                "excludes": "the first steps, the step timer's anchor runs, an epoch's short last batch"}

    def figures(self):
        """This rank's steady-state step: {step_s, compute_s, comm_exposed_s, comm_total_s} (compute = step -
        exposed), medians over the steps StepTimer.steady() keeps (steady_state())."""
        wall = np.array([s[0] for s in self.timer.steps], np.float64)
        keep = self.timer.steady(len(wall))
        step = float(np.median(wall[keep])) if len(wall) else 0.0
        exposed = float(np.median(np.array(self.exposed)[keep])) if self.exposed else 0.0
        total = float(np.median(np.array(self.total)[keep])) if self.total else 0.0
        return {"step_s": step, "compute_s": step - exposed, "comm_exposed_s": exposed, "comm_total_s": total}


def memory_table(persistent, peak):
    rows = [f"  {'category':<16}{'at step':>12}{'peak':>12}"]
    for c in memory.CATEGORIES:
        rows.append(f"  {c:<16}{fmt_bytes(persistent.get(c, 0)):>12}{fmt_bytes(peak[c]):>12}")
    rows.append(f"  {'total':<16}{fmt_bytes(sum(persistent.values())):>12}{fmt_bytes(peak['total']):>12}")
    return "\n".join(rows)


def write_json(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def plan_comparison(args, world, steps, peak_total, kind="mlp", vocab_size=None, moe_load=1.0, moe_load_step=None,
                    moe_load_per_stage=None):
    """The planner's prediction for this job's options beside what the job measured (minitrain/plan), for the
    JSON (always) and the planner line (--show-plan): ``steps`` is the slowest rank's StepTimer summary; the
    planner is told the BLAS threads this process runs with and, with experts, the run's routing (its busiest
    rank's experts' rows over its own routed rows: the memory at ``moe_load``, the most loaded step's, with a
    load of 1 beside; the step at ``moe_load_step``, the median step's, as the step is the median; with
    ``moe_load_per_stage``, each pipeline stage's memory at its own ranks' load, the largest of them compared).
    Time is compared as plan/validate.py compares it: the step's busy CPU time in units of the anchor (which
    the machine's other jobs slow alike) against the planner's compute and its collectives' own work; the
    wall clock beside (also in anchors)."""
    from .. import backend, plan
    try:
        model, layout = (plan.mlp_from_args(args, world) if kind == "mlp"
                         else plan.gpt_from_args(args, world, vocab_size))
        layout = plan.Layout(**{**layout.fields(), "threads": backend.blas_threads() or 0})
        machine = plan.load_machine()

        @functools.lru_cache(maxsize=None)           # each load predicted once (equal loads: one prediction)
        def at(load):
            return plan.predict(model, plan.Layout(**{**layout.fields(), "moe_load": load}), machine)
        moe_load_step = moe_load if moe_load_step is None else moe_load_step
        predicted, step = at(moe_load), at(moe_load_step)
        memory = predicted["memory_bytes"]["total"]
        if moe_load_per_stage and len(set(moe_load_per_stage)) > 1:
            memory = max(at(load)["memory_bytes_per_stage"][s]["total"] for s, load in enumerate(moe_load_per_stage))
        even = at(1.0)["memory_bytes"]["total"] if moe_load != 1 else None
    except plan.LayoutError as e:
        return {"kind": kind, "world": world, "refused": str(e)}
    from ..plan.time import typical
    anchor = machine.get("anchor_cpu_time_s", 0.0) * typical(machine, world)   # as a job's step meets it
    return {"kind": kind, "world": world, "threads": layout.threads, "moe_load": moe_load,
            "moe_load_step": moe_load_step, **({"moe_load_per_stage": list(moe_load_per_stage)}
                                               if moe_load_per_stage else {}),
            "predicted": {"step_busy_s": step["step_busy_s"], "step_time_s": step["step_time_s"]["total"],
                          "memory_bytes": memory,
                          **({"memory_bytes_even_routing": even} if even is not None else {})},
            "measured": {"step_busy_in_anchors_s": steps["step_busy_per_anchor"] * anchor,
                         "step_busy_fastest_s": steps["step_busy_cpu_time_min_s"],
                         "step_time_s": steps["step_time_s"],
                         "step_wall_in_anchors_s": steps.get("step_wall_per_anchor", 0.0) * anchor,
                         "memory_bytes": peak_total}}


def planner_line(compared):
    """One line: the planner's prediction beside the measured step and memory (plan_comparison's dict)."""
    kind, world = compared["kind"], compared["world"]
    if "refused" in compared:
        return f"planner: refuses this layout ({compared['refused']})"
    predicted, got = compared["predicted"], compared["measured"]
    busy = got["step_busy_in_anchors_s"]
    timed = got["step_time_s"] > 0           # none: a resumed run whose only step was an epoch's short last batch
    measured = (f"{busy * 1e3:.2f} ms measured (the step's own thread, in anchors)" if busy
                else f"{got['step_busy_fastest_s'] * 1e3:.2f} ms measured (fastest step)" if timed
                else "no step measured")
    wall = f"; {got['step_wall_in_anchors_s'] * 1e3:.2f} ms in anchors" if got["step_wall_in_anchors_s"] else ""
    if compared["threads"] > 1:             # the other BLAS threads' work is not this thread's CPU time
        measured += f" with {compared['threads']} BLAS threads (OMP_NUM_THREADS=1 to compare)"
    return (f"planner (python -m minitrain.plan {kind} <these options> --world {world}): step busy CPU "
            f"{predicted['step_busy_s'] * 1e3:.2f} ms predicted, {measured}; wall "
            f"{predicted['step_time_s'] * 1e3:.2f} ms predicted, "
            + (f"{got['step_time_s'] * 1e3:.2f} ms measured (median, slowest rank{wall})" if timed
               else "no step measured")
            + f"; peak memory per rank {fmt_bytes(predicted['memory_bytes'])} predicted"
            + (f" (--moe-load {compared['moe_load']:.3g}: this run's busiest rank's experts took that many rows per "
               f"row it routed in its most loaded step, {compared['moe_load_step']:.3g} in its median step, where "
               f"the step is priced; {fmt_bytes(predicted['memory_bytes_even_routing'])} at a load of 1"
               + (f"; each pipeline stage's memory at its own ranks' load: "
                  f"{', '.join(f'{x:.3g}' for x in compared['moe_load_per_stage'])}"
                  if len(set(compared.get("moe_load_per_stage", ()))) > 1 else "") + ")"
               if "memory_bytes_even_routing" in predicted else "") + f", {fmt_bytes(got['memory_bytes'])} measured")


def show_plan(args, compared):
    """The planner line, printed with --show-plan (the JSON always holds it)."""
    if getattr(args, "show_plan", False):
        print(planner_line(compared))


def traced(fn, name):
    """``fn`` run inside a trace span ``name`` (the jobs trace their forward and optimizer phases this way, so
    their loops hold no trace lines; StepWatch names the gap between them backward)."""
    def run(*args, **kwargs):
        with trace.span(name):
            return fn(*args, **kwargs)
    return run

"""Grader: the library's schedule checker and simulator with the backward split into B and W (every
F, B and W once per stage, W after its B, no deadlock), ZB-H1's memory (at most min(p, m)
micro-batches in flight on every stage, from a micro-batch's F to its W) and its idle time per stage
(p-1)(F+B-W) (Qi et al. 2024, sec. 2.1) at F = B = W = 1 and at F = 1, B = 2, W = 1, for m >= p;
p = 1..4, m = 1..8."""
from ..grading import Check, Mismatch
from ..oracles import simulate_schedule

TITLE = "the ZB-H1 zero-bubble pipeline schedule (backward split into B and W)"
ORDER = 135
KIND = "implement"
NOTEBOOK = "05_pipeline"
DEFINES = "zb_h1"
MICROBATCHES = range(1, 9)
COSTS = ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0))          # (F, B, W)

STUB = '''"""Exercise zb_h1_schedule: ZB-H1, the first zero-bubble schedule (Qi et al. 2024, "Zero
Bubble Pipeline Parallelism", sec. 2.1), what minitrain's zb_h1 runs.

A layer's backward is two pieces of work. B computes the gradient of the layer's input: the
stage before waits for it, so B sits on the pipeline's critical path. W computes the gradient of
the layer's weights: nobody waits for it, so it can run later, whenever the stage would otherwise
be idle (minitrain.autograd.defer_weight_grads runs B now and queues W). Until its W has run, a
micro-batch's activations stay in memory.

Write zb_h1(p, m): a list of p lists, stage s's actions in order, each a tuple ("F", i)
(forward of micro-batch i), ("B", i) (its input gradient) or ("W", i) (its weight gradient),
0 <= i < m. Stage s receives F's input from stage s-1 and B's gradient from stage s+1; W needs
only this stage's B of the same micro-batch. Each stage runs its list in order, each action as
soon as what it needs exists.

The test to pass (the library's checker and simulator, for p = 1..4 and m = 1..8):
  - every micro-batch's F, B and W exactly once per stage, each W after its B, no deadlock;
  - ZB-H1's memory: at most min(p, m) micro-batches in flight on any stage (in flight: from a
    micro-batch's F to its W);
  - for m >= p, the idle time of every stage is the paper's (p-1)(F+B-W), with costs F = B = W = 1
    and with F = 1, B = 2, W = 1 (1F1B, its backward not split, idles (p-1)(F+B+W): three times
    as much at unit costs).

Check it:  python -m minitrain.exercises check zb_h1_schedule mine.py
Stuck?     python -m minitrain.exercises hint zb_h1_schedule
"""


def zb_h1(p, m):
    raise NotImplementedError("zb_h1: return p lists of ('F', i) / ('B', i) / ('W', i) actions")
'''

HINTS = (
    "Start from 1F1B (exercise one_f_one_b): with W split off, its F and B keep 1F1B's order. Running "
    "each W right after its B is correct, and gains a little (B's gradient leaves before W runs, so "
    "the stages idle (p-1)(F+B) instead of (p-1)(F+B+W)), but no more. W waits for nothing but its "
    "own B and nobody waits for W: it is the one piece of work you may move. Where does a stage of "
    "1F1B sit idle? Draw p = 3, m = 4 with unit costs.",
    "The idle time 1F1B cannot avoid is at the end (the drain): the last stage finishes its "
    "backwards first, stage 0 last. Postponing some Ws fills it, but every postponed W keeps its "
    "micro-batch in flight, and the bound is min(p, m). Stage 0 already holds p micro-batches "
    "after its warm-up, so it can postpone nothing; each stage further down holds one fewer, so it "
    "can afford to postpone one W more.",
    "Stage s warms up with w = min(p - s - 1, m) forwards, as in 1F1B. Then for i = 0 .. m-1: the "
    "forward F(w + i) if w + i < m, then B(i), then, once i >= s, the oldest W not yet run (W(i - s)). "
    "At the end, the Ws still owed, oldest first.",
)


def _simulate(impl, p, m, costs=COSTS[0]):
    """The library's checker and simulator on the learner's schedule, its errors explained."""
    try:
        return simulate_schedule(impl, p, m, kinds="FBW", costs=costs)[1]
    except Mismatch as e:
        text = str(e)
        if "deadlocks" in text:
            text += (". Each stage runs its list in order and an action waits for its inputs (F(i) for F(i) "
                     "of the stage before, B(i) for B(i) of the stage after): here the stages wait for each "
                     "other in a circle, each for an action that comes later in another's list")
        elif "comes before its input-gradient backward B" in text:
            text += (". W(i) computes the weight gradient from the gradient of the stage's output that B(i) "
                     "received (and saved for it): on every stage W(i) must come after B(i)")
        raise Mismatch(text) from None


def _sound(impl, p):
    for m in MICROBATCHES:
        _simulate(impl, p, m)


def _memory(impl, p):
    for m in MICROBATCHES:
        peak = _simulate(impl, p, m)["peak_activations"]
        bound = min(p, m)
        over = [s for s in range(p) if peak[s] > bound]
        if over:
            raise Mismatch(f"zb_h1(p={p}, m={m}): micro-batches in flight at the peak, per stage: {peak}; ZB-H1 "
                           f"keeps at most min(p, m) = {bound} (1F1B's peak). Stage {over[0]} holds "
                           f"{peak[over[0]]}: a micro-batch stays in memory until its W, so it postpones its Ws "
                           f"too long")


def _idle(impl, p):
    for m in MICROBATCHES:
        if m < p:
            continue                  # fewer micro-batches than stages: the drain cannot be filled
        for f, b, w in COSTS:
            idle = _simulate(impl, p, m, (f, b, w))["idle_per_stage"]
            want, unsplit, split = (p - 1) * (f + b - w), (p - 1) * (f + b + w), (p - 1) * (f + b)
            wrong = [s for s in range(p) if abs(idle[s] - want) > 1e-9]
            if wrong:
                s = wrong[0]
                text = (f"zb_h1(p={p}, m={m}) with F={f:g}, B={b:g}, W={w:g}: stage {s} is idle {idle[s]:g} "
                        f"(every stage: {[round(x, 3) for x in idle]}); ZB-H1 idles (p-1)(F+B-W) = {want:g} "
                        f"per stage (1F1B, its backward whole: (p-1)(F+B+W) = {unsplit:g})")
                if all(abs(x - split) < 1e-9 for x in idle):
                    text += (f". Yours idles (p-1)(F+B) = {split:g}: each B sends its gradient on before its W "
                             f"runs, which takes W off the critical path, but no W is left over to fill the "
                             f"drain at the end (1F1B with the backward cut in two)")
                elif idle[s] > want:
                    text += ". Some stage still waits where one of its postponed Ws could have run"
                raise Mismatch(text)


def checks():
    out = []
    for p in (1, 2, 3, 4):
        out += [Check(f"p={p}: deadlock-free, every F, B, W once, W after its B (m = 1..8)",
                      lambda f, p=p: _sound(f, p), 1),
                Check(f"p={p}: in flight <= min(p, m) (from F to W)", lambda f, p=p: _memory(f, p), 2),
                Check(f"p={p}: idle per stage (p-1)(F+B-W) for m = p..8", lambda f, p=p: _idle(f, p), 3)]
    return out


def reference():
    from minitrain.parallel.pipeline import get_schedule

    def zb_h1(p, m):
        return get_schedule("zb_h1", p, m)
    return zb_h1

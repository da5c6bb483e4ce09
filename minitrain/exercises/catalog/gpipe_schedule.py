"""Grader: the library's schedule checker and simulator (every unit computed once, backward after
forward, no deadlock), GPipe's bubble (p-1)/(m+p-1) with forward cost 1 and backward cost 2, and
GPipe's memory: all m micro-batches in flight on every stage; p = 1..4, m = 1..8."""
from ..grading import Check, Mismatch
from ..oracles import simulate_schedule

TITLE = "the GPipe pipeline schedule (all forwards, then all backwards)"
ORDER = 120
KIND = "implement"
NOTEBOOK = "05_pipeline"
DEFINES = "gpipe"
MICROBATCHES = range(1, 9)

STUB = '''"""Exercise gpipe_schedule: GPipe (Huang et al. 2019), the pipeline schedule the others improve on.

A model cut into p stages, one per rank; a batch cut into m micro-batches. Stage s receives a
micro-batch's activations from stage s-1 (forward) and its gradient from stage s+1 (backward), so
an action can run only once what it needs exists. A schedule says, for each stage, in which order
it runs its 2m actions.

Write gpipe(p, m): a list of p lists, stage s's actions in order, each action a tuple ("F", i)
(forward of micro-batch i) or ("B", i) (backward of micro-batch i), 0 <= i < m.

The test to pass (the library's checker and simulator, forward cost 1, backward cost 2, for
p = 1..4 and m = 1..8):
  - every micro-batch's forward and backward exactly once on every stage, each backward after
    its forward, and no deadlock;
  - the bubble (idle share of p stages x the run's length) is (p-1)/(m+p-1);
  - GPipe's memory: every stage holds all m micro-batches' activations at its peak.

Check it:  python -m minitrain.exercises check gpipe_schedule mine.py
Stuck?     python -m minitrain.exercises hint gpipe_schedule
"""


def gpipe(p, m):
    raise NotImplementedError("gpipe: return p lists of ('F', i) / ('B', i) actions")
'''

HINTS = (
    "GPipe is the simplest pipelined schedule: every stage runs the forwards of all m micro-batches, "
    "then (the flush) the backwards of all of them. Interleaving a forward and a backward per "
    "micro-batch (F0 B0 F1 B1 ...) is not pipelining: it leaves p-1 stages idle all the time.",
    "Every stage has the same list: m forwards, then m backwards. In which order should the backwards "
    "go? The last stage finishes the last micro-batch's forward last; either order is correct, the "
    "library's runs them newest first (m-1 down to 0).",
    "[[('F', i) for i in range(m)] + [('B', i) for i in reversed(range(m))] for s in range(p)]",
)


def _rule(impl, p, rule):
    from minitrain.parallel.pipeline import formula_bubble_fraction
    for m in MICROBATCHES:
        _, sim = simulate_schedule(impl, p, m)
        if rule == "bubble":
            want = formula_bubble_fraction("gpipe", p, m)
            if abs(sim["bubble_fraction"] - want) > 1e-9:
                raise Mismatch(f"gpipe(p={p}, m={m}): bubble {sim['bubble_fraction']:.4f}, GPipe's is (p-1)/(m+p-1) "
                               f"= {want:.4f} (naive model parallelism, one micro-batch at a time, has (p-1)/p = "
                               f"{(p - 1) / p:.4f})")
        if rule == "memory" and sim["peak_activations"] != [m] * p:
            raise Mismatch(f"gpipe(p={p}, m={m}): micro-batches in flight at the peak, per stage: "
                           f"{sim['peak_activations']}; GPipe runs every forward before any backward, so every "
                           f"stage holds all {m}")


def checks():
    out = []
    for p in (1, 2, 3, 4):
        out += [Check(f"p={p}: deadlock-free, every unit once (m = 1..8)", lambda f, p=p: _rule(f, p, "sound"), 1),
                Check(f"p={p}: bubble (p-1)/(m+p-1)", lambda f, p=p: _rule(f, p, "bubble"), 1),
                Check(f"p={p}: all m micro-batches in flight at the peak", lambda f, p=p: _rule(f, p, "memory"), 2)]
    return out


def reference():
    from minitrain.parallel.pipeline import get_schedule

    def gpipe(p, m):
        return get_schedule("gpipe", p, m)
    return gpipe

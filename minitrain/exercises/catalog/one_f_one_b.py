"""Grader: the library's schedule checker and simulator (every unit once, backward after forward,
no deadlock), the bubble (p-1)/(m+p-1) and 1F1B's memory bound, at most min(p-s, m) micro-batches in
flight on stage s (GPipe's m fails it); p = 1..4, m = 1..8."""
from ..grading import Check, Mismatch
from ..oracles import simulate_schedule

TITLE = "the 1F1B pipeline schedule (GPipe's bubble, bounded memory)"
ORDER = 130
KIND = "implement"
NOTEBOOK = "05_pipeline"
DEFINES = "one_f_one_b"
MICROBATCHES = range(1, 9)

STUB = '''"""Exercise one_f_one_b: the 1F1B schedule (PipeDream-Flush, Narayanan et al. 2021), what
Megatron-LM and DeepSpeed run.

GPipe runs all m forwards before any backward, so every stage keeps m micro-batches' activations.
1F1B keeps GPipe's bubble but starts backwards early, so that stage s never holds more than
min(p - s, m) micro-batches.

Write one_f_one_b(p, m): a list of p lists, stage s's actions in order, each a tuple ("F", i)
(forward of micro-batch i) or ("B", i) (backward of micro-batch i), 0 <= i < m. Stage s receives
its forward input from stage s-1 and its backward gradient from stage s+1, so an action can only
run once those exist.

The test to pass (the library's checker and simulator, forward cost 1, backward cost 2, for
p = 1..4 and m = 1..8):
  - every micro-batch's forward and backward exactly once per stage, no deadlock;
  - the bubble is GPipe's, (p-1)/(m+p-1);
  - at most min(p - s, m) micro-batches in flight on stage s.

Check it:  python -m minitrain.exercises check one_f_one_b mine.py
Stuck?     python -m minitrain.exercises hint one_f_one_b
"""


def one_f_one_b(p, m):
    raise NotImplementedError("one_f_one_b: return p lists of ('F', i) / ('B', i) actions")
'''

HINTS = (
    "Three phases per stage: a warm-up of forwards only, a steady phase alternating one forward and "
    "one backward (hence 1F1B), and a cool-down of the remaining backwards. Each kind runs in "
    "micro-batch order (F0, F1, ... and B0, B1, ...).",
    "How long is the warm-up? The last stage can run B0 right after F0: it needs no warm-up. An "
    "earlier stage must keep the stages after it busy until the first gradient comes back: one "
    "forward in flight per later stage. Too few warm-up forwards leave stages idle (a bigger bubble) "
    "or deadlock; too many hold more micro-batches than the bound.",
    "Stage s warms up with w = min(p - s - 1, m) forwards F0 .. F(w-1); then for i = 0 .. m-w-1 it "
    "runs F(w + i) followed by B(i); then B(m - w) .. B(m - 1).",
)


def _rule(impl, p, rule):
    from minitrain.parallel.pipeline import formula_bubble_fraction
    for m in MICROBATCHES:
        _, sim = simulate_schedule(impl, p, m)
        if rule == "bubble":
            want = formula_bubble_fraction("1f1b", p, m)
            if abs(sim["bubble_fraction"] - want) > 1e-9:
                raise Mismatch(f"one_f_one_b(p={p}, m={m}): bubble {sim['bubble_fraction']:.4f}, expected "
                               f"(p-1)/(m+p-1) = {want:.4f}: some stage waits longer than it must "
                               f"(idle share per stage: {[round(b, 3) for b in sim['bubble_per_stage']]})")
        if rule == "memory":
            bound = [min(p - s, m) for s in range(p)]
            over = [s for s in range(p) if sim["peak_activations"][s] > bound[s]]
            if over:
                raise Mismatch(f"one_f_one_b(p={p}, m={m}): micro-batches in flight at the peak, per stage: "
                               f"{sim['peak_activations']}; 1F1B keeps at most min(p-s, m) = {bound} (stage "
                               f"{over[0]} holds {sim['peak_activations'][over[0]]})")


def checks():
    out = []
    for p in (1, 2, 3, 4):
        out += [Check(f"p={p}: deadlock-free, every unit once (m = 1..8)", lambda f, p=p: _rule(f, p, "sound"), 2),
                Check(f"p={p}: bubble (p-1)/(m+p-1)", lambda f, p=p: _rule(f, p, "bubble"), 2),
                Check(f"p={p}: in flight <= min(p-s, m)", lambda f, p=p: _rule(f, p, "memory"), 2)]
    return out


def reference():
    from minitrain.parallel.pipeline import get_schedule

    def one_f_one_b(p, m):
        return get_schedule("1f1b", p, m)
    return one_f_one_b

"""Grader: where to cut a pipeline's layers (the linear partition problem, partition.py's
balanced_split_points). The answer's shape (parts - 1 increasing starts in 1..n-1); the largest
group's cost == the optimum by brute force over every cut (equal costs, a heavy layer anywhere, ReLUs'
zeros between, parts == 1 and == n, a greedy's trap) and == minitrain's on seeded random costs; no
group of free layers alone when enough layers cost something; 2- and 4-stage PipelineParallels cut
where the learner says == one process (float64, 1e-10). Slips named: greedy filling, equal numbers of
layers, prefix sums one layer off."""
import itertools
import numbers

import numpy as np

from ...parallel.pipeline.partition import balanced_split_points
from ..grading import Check, Mismatch
from ..oracles import pipeline_matches_one_process

TITLE = "the pipeline's split points: contiguous groups of layers, the largest group's cost as small as possible"
ORDER = 133
KIND = "implement"
NOTEBOOK = "05_pipeline"
DEFINES = "balanced_split_points"

STUB = '''"""Exercise pipeline_partition: a pipeline runs at the pace of its slowest stage. PipelineParallel
cuts an nn.Sequential into p contiguous stages, and where it cuts decides how long every other stage
waits. Each layer has a cost (minitrain counts multiply-adds from its parameters: a Linear costs,
a ReLU costs 0); the best cut makes the most expensive stage as cheap as possible. This is the
classic linear partition problem.

Write balanced_split_points(sizes, parts): sizes is a list of n layer costs (integers >= 0),
1 <= parts <= n. Cut the layers into parts contiguous, non-empty groups and return where groups
2..parts start: a list of parts - 1 increasing layer indices, each in 1..n-1 (the first group
always starts at 0 and is not listed). sizes [3, 1, 1, 1] into 2 parts: [1] (groups [3] and
[1, 1, 1], largest cost 3); into 1 part: [].

Contract:
  - the largest group's cost (the sum of its layers' sizes) is as small as any cut's; when several
    cuts reach it, any one will do, except:
  - no group holds only layers of cost 0 when the layers that cost something number at least
    parts: a stage of only ReLUs does no work, and its rank idles the whole step;
  - leave sizes as it is.

The test to pass:
  - the answer's shape, on every case below;
  - the largest group's cost == the best of every possible cut (tried one by one): equal costs, one
    heavy layer first, last or in the middle, zeros between, parts == 1 and parts == n; and ==
    minitrain's on seeded random costs, up to 40 layers into up to 8 parts;
  - no group of free layers alone when it can be avoided;
  - 2- and 4-stage PipelineParallels of an MLP of unequal widths, split_points=your cut, train a
    step == one process (float64, 1e-10).

Check it:  python -m minitrain.exercises check pipeline_partition mine.py
Stuck?     python -m minitrain.exercises hint pipeline_partition
"""


def balanced_split_points(sizes, parts):
    raise NotImplementedError("balanced_split_points: the starts of groups 2..parts, the largest group as cheap as can be")
'''

HINTS = (
    "Filling each stage up to total / parts and moving on (greedy) is not optimal: on [4, 3, 3, 4] into 3 "
    "parts it makes [4] [3] [3, 4], largest 7, where [4] [3, 3] [4] has 6. Neither is cutting every n / parts "
    "layers: equal numbers of layers are not equal cost. Think recursively: the best cut of the first i "
    "layers into k groups is the best, over where the last group starts (j), of the larger of the best cut of "
    "the first j layers into k - 1 groups and the cost of layers j..i-1.",
    "Dynamic programming over prefix sums: prefix[0] = 0, prefix[i + 1] = prefix[i] + sizes[i], so layers "
    "j..i-1 cost prefix[i] - prefix[j]. best[k][i], the first i layers in k groups: best[0][0] = 0, others "
    "infinite; best[k][i] = min over j in k-1..i-1 of max(best[k - 1][j], prefix[i] - prefix[j]). Keep the "
    "argmin j (start[k][i]) and walk back from (parts, n) to read the cuts.",
    "The free-layer rule: count the layers that cost something, weighted[i] = how many of the first i have "
    "sizes > 0. If weighted[n] >= parts, skip every j with weighted[i] == weighted[j] (that group would hold "
    "only zeros). Walk back: i = n; for k = parts..1: i = start[k][i]; points.append(i). Return "
    "sorted(points)[1:] (the last i is always 0, the first group's start).",
)


def _groups(sizes, cut):
    bounds = [0, *cut, len(sizes)]
    return [sizes[a:b] for a, b in zip(bounds, bounds[1:])]


def _largest(sizes, cut):
    return max(sum(g) for g in _groups(sizes, cut))


def _show(sizes, cut):
    return " ".join(str(g) for g in _groups(sizes, cut)).replace(",", "")


def _optima(sizes, parts):
    """(the best largest cost, every cut reaching it), by trying every cut."""
    cuts = [list(c) for c in itertools.combinations(range(1, len(sizes)), parts - 1)]
    best = min(_largest(sizes, c) for c in cuts)
    return best, [c for c in cuts if _largest(sizes, c) == best]


def _greedy(sizes, parts):
    """The slip: fill each group up to total / parts, cut before the layer that would pass it."""
    target, cut, acc = sum(sizes) / parts, [], 0
    for i, s in enumerate(sizes):
        if (acc + s > target and acc > 0 or len(sizes) - i == parts - 1 - len(cut)) and len(cut) < parts - 1:
            cut.append(i)
            acc = 0
        acc += s
    return cut


def _by_count(n, parts):
    """Equal numbers of layers: every n / parts (floored, rounded or as numpy's array_split)."""
    sizes = [n // parts + (k < n % parts) for k in range(parts)]
    return [[k * n // parts for k in range(1, parts)], [round(k * n / parts) for k in range(1, parts)],
            list(itertools.accumulate(sizes))[:-1]]


CASES = [([5, 5, 5, 5], 2, "equal costs"), ([5, 5, 5, 5, 5, 5], 3, "equal costs"), ([9, 1, 1, 1, 1], 2, "heavy first"),
         ([1, 1, 1, 1, 9], 3, "heavy last"), ([1, 2, 12, 2, 1, 1], 3, "heavy in the middle"),
         ([4, 3, 3, 4], 3, "a greedy's trap"), ([3, 3, 2, 4, 4], 3, "a greedy's trap"),
         ([2, 0, 5, 0, 1, 0, 6, 0, 3], 3, "an MLP: ReLUs (0) between"), ([10, 0, 1, 0, 1, 0, 1, 0, 1], 2, "zeros"),
         ([1, 7, 2, 8, 3, 1], 6, "parts == n"), ([4, 1, 6], 1, "parts == 1"), ([7], 1, "one layer"),
         ([0, 3, 0], 3, "parts > layers that cost something"), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 4, "eleven layers")]
FREE = [([6, 0, 1, 0, 1], 3), ([1, 0, 1, 0, 6], 3), ([8, 0, 0, 2, 2, 0, 2], 3), ([5, 0, 0, 5, 1], 3),
        ([0, 0, 4, 0, 4, 0, 0], 2), ([4, 0, 4, 0, 4, 0], 3)]


def _random(seed, many):
    rng = np.random.default_rng(seed)
    for _ in range(many):
        n = int(rng.integers(9, 41))
        sizes = [int(s) if rng.random() > 0.3 else 0 for s in rng.integers(1, 30, n)]
        yield sizes, int(rng.integers(2, min(8, n) + 1))


def _cut(impl, sizes, parts):
    """The learner's cut, checked for shape; a Mismatch naming what is wrong with it."""
    what = f"balanced_split_points({sizes}, {parts})"
    given = list(sizes)
    got = impl(given, parts)
    if given != list(sizes):
        raise Mismatch(f"{what} changed sizes; leave it as it is (the caller keeps it)")
    try:
        cut = list(got)
    except TypeError:
        raise Mismatch(f"{what} returned {type(got).__name__} {got!r:.60}; return a list of layer indices") from None
    if not all(isinstance(i, numbers.Integral) for i in cut):
        raise Mismatch(f"{what} returned {cut!r:.80}; expected integer layer indices")
    cut, n = [int(i) for i in cut], len(sizes)
    if len(cut) == parts and cut[:1] == [0]:
        raise Mismatch(f"{what} returned {cut}: the first group's start, 0, is not listed; return where "
                       f"groups 2..parts start, parts - 1 = {parts - 1} of them")
    if len(cut) == parts and cut[-1:] == [n]:
        raise Mismatch(f"{what} returned {cut}: the end, len(sizes) = {n}, is not listed; return where groups "
                       f"2..parts start, parts - 1 = {parts - 1} of them")
    if len(cut) != parts - 1:
        why = " (these are the groups' sizes? return where each group starts)" if sum(cut) == n > parts else ""
        raise Mismatch(f"{what} returned {cut}: {len(cut)} indices, expected parts - 1 = {parts - 1}, where groups "
                       f"2..parts start{why}")
    if cut[:1] == [0] and [i + 1 for i in cut] == sorted(set(i + 1 for i in cut)) and cut[-1] < n - 1:
        raise Mismatch(f"{what} returned {cut}: 0 is the first group's start, never listed. Where groups end (their "
                       "last layer)? Return where groups 2..parts start, each one past the group before's last")
    if cut != sorted(set(cut)) or not all(0 < i < n for i in cut):
        raise Mismatch(f"{what} returned {cut}, expected parts - 1 = {parts - 1} increasing indices in 1..{n - 1}: every group "
                       "needs at least one layer, so each start is in 1..n-1 and the starts increase")
    return cut, what


def _shape(impl):
    for sizes, parts, _ in CASES:
        _cut(impl, sizes, parts)
    for sizes, parts in FREE + list(_random(1, 20)):
        _cut(impl, sizes, parts)


def _slip(seen):
    """The slip that explains every cut seen in one check ([(sizes, parts, cut)]), or ""."""
    if all(cut == _greedy(sizes, parts) for sizes, parts, cut in seen):
        return ("That is the greedy cut (fill each stage up to total / parts, then start the next), on every case: a "
                "cut made early cannot be undone; compare every place the last group can start")
    if all(cut in _by_count(len(sizes), parts) for sizes, parts, cut in seen):
        return "That is equal numbers of layers, not equal cost, on every case: cut by the sizes, not by the count"
    for how, move in (("right", lambda s: s[1:] + [0]), ("left", lambda s: [0] + s[:-1])):
        if all(_largest(move(sizes), cut) == _largest(move(sizes), balanced_split_points(move(sizes), parts))
               for sizes, parts, cut in seen):
            return (f"Your cuts are the best ones, on every case, if each layer cost its {how} neighbour's size: the "
                    "prefix sums are one layer off. With prefix[0] = 0 and prefix[i + 1] = prefix[i] + sizes[i], "
                    "layers j..i-1 cost prefix[i] - prefix[j]")
    return ""


def _optimal(impl, cases, brute=True):
    """Every case's largest group == the best cut's (by trying every cut, or minitrain's on big cases)."""
    seen, wrong = [], None
    for sizes, parts, name in cases:
        cut, what = _cut(impl, sizes, parts)
        seen.append((sizes, parts, cut))
        best = _optima(sizes, parts)[1][0] if brute else balanced_split_points(sizes, parts)
        if wrong is None and _largest(sizes, cut) != _largest(sizes, best):
            wrong = (f"{name}: {what} cut {_show(sizes, cut)}, largest group {_largest(sizes, cut)}; the best cut's "
                     f"largest is {_largest(sizes, best)}, e.g. {best}: {_show(sizes, best)}")
    if wrong:
        raise Mismatch(" ".join(filter(None, (wrong + ".", _slip(seen)))))


def _no_free_group(impl):
    for sizes, parts in FREE + list(_random(3, 40)):
        if sum(s > 0 for s in sizes) < parts:
            continue
        cut, what = _cut(impl, sizes, parts)
        for k, group in enumerate(_groups(sizes, cut)):
            if not any(group):
                raise Mismatch(f"{what} cut {_show(sizes, cut)}: group {k + 1} holds only layers of cost 0 (ReLUs, "
                               f"say). A stage of only ReLUs does no work and idles the whole step; with "
                               f"{sum(s > 0 for s in sizes)} layers that cost something every one of the {parts} "
                               "groups can hold one, at the same largest cost: skip the cuts that leave a group free "
                               f"(minitrain cuts {balanced_split_points(sizes, parts)})")


def _mlp():
    from ... import manual_seed, nn
    manual_seed(0)
    return nn.Sequential(nn.Linear(3, 24), nn.ReLU(), nn.Linear(24, 4), nn.ReLU(), nn.Linear(4, 16), nn.ReLU(),
                         nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).to(np.float64)


def _batch():
    return np.random.default_rng(5).standard_normal((8, 3)), np.random.default_rng(6).standard_normal((8, 2))


def _pipeline(impl, p):
    from ...parallel.pipeline.partition import counted_costs, parameter_costs
    cut, what = _cut(impl, counted_costs(parameter_costs(list(_mlp()))), p)
    pipeline_matches_one_process(p, "1f1b", _mlp, _batch(), f"a {p}-stage 1F1B PipelineParallel cut at {cut} ({what})",
                                 split_points=cut)


def checks():
    small = [c for c in CASES if "trap" not in c[2]]
    return [Check("the answer's shape: parts - 1 increasing layer indices in 1..n-1, where groups 2..parts start",
                  _shape, 1),
            Check("the largest group's cost == the best cut's (every cut tried): equal costs, a heavy layer, zeros, "
                  "parts == 1 and == n", lambda f: _optimal(f, small), 1),
            Check("the largest group's cost == the best cut's where a greedy fill falls short",
                  lambda f: _optimal(f, [c for c in CASES if "trap" in c[2]]), 1),
            Check("the largest group's cost == minitrain's on seeded random costs (up to 40 layers, 8 parts)",
                  lambda f: _optimal(f, [(s, p, "random costs") for s, p in _random(2, 60)], brute=False), 2),
            Check("no group of free layers (cost 0) alone when enough layers cost something", _no_free_group, 3),
            Check("a 2-stage PipelineParallel cut where you say trains a step == one process",
                  lambda f: _pipeline(f, 2), 2),
            Check("a 4-stage PipelineParallel cut where you say trains a step == one process",
                  lambda f: _pipeline(f, 4), 2)]


def reference():
    """minitrain's own: partition.py's dynamic programme over the prefix sums."""
    return balanced_split_points

"""Grader: MoE token dispatch and combine (GShard, Lepikhin et al. 2021; Switch, Fedus et al.
2022), against minitrain.nn.moe_dispatch: the dispatched rows, counts and slots exactly (top-1 and
top-2, with and without capacity, experts nobody chose), and the gate-weighted combine to 1e-12."""
import types

import numpy as np

from ..comparing import as_array, compare, host, host_all, to_learner
from ..grading import Check, Mismatch

TITLE = "MoE dispatch and combine: rows grouped by expert, capacity, the gate-weighted sum back"
ORDER = 195
KIND = "implement"
NOTEBOOK = "14_experts"
DEFINES = ("dispatch", "combine")

STUB = '''"""Exercise moe_dispatch_combine: in a mixture of experts each token chooses k experts; dispatch
copies its row to each chosen expert (rows grouped expert by expert, the split sizes an
all-to-all sends), and combine brings the experts' outputs back, weighted by the gates.

Write dispatch(x, choices, num_experts, capacity) and combine(y, gates, slots).

dispatch contract:
  - x is (N, C) token rows; choices is (N, k) integer expert indices: choices[t, j] is token t's
    j-th choice (j = 0 its first); capacity is an int, or None for no limit;
  - each of the N*k choices is called by its slot t*k + j;
  - rows are ordered expert by expert (expert 0 first); within one expert: the first choices
    (j = 0) of all tokens in token order, then the second choices (j = 1) in token order, ...;
  - an expert keeps at most capacity choices, the first ones in that order; the rest are dropped;
  - return (rows, counts, slots): rows (M, C) with rows[m] = x[slots[m] // k]; counts, a list of
    num_experts ints (rows per expert, summing to M); slots, an (M,) integer array.

combine contract:
  - y is (M, C): the experts' output rows, in the order dispatch returned; gates is (N, k)
    (gates[t, j] weighs token t's j-th choice); slots is what dispatch returned;
  - return (N, C): out[t] = sum over the kept choices j of token t of gates[t, j] * (its row of y);
    a dropped choice adds nothing, a token with every choice dropped gets a row of zeros.

The test to pass: top-1 and top-2 routing, no capacity and a tight one, experts nobody chose;
rows, counts and slots exactly, combine to 1e-12, against minitrain.nn.moe_dispatch.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check moe_dispatch_combine mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check moe_dispatch_combine mine.py
Stuck?     python -m minitrain.exercises hint moe_dispatch_combine
"""
import numpy as np


def dispatch(x, choices, num_experts, capacity):
    raise NotImplementedError("dispatch: group the token rows by expert")


def combine(y, gates, slots):
    raise NotImplementedError("combine: the gate-weighted sum of each token's rows")
'''

HINTS = (
    "List the slots in priority order first: choices.T.reshape(-1) walks j = 0 for every token, then "
    "j = 1, ...; the slot of its i-th entry is (i % N) * k + i // N. Then a stable sort by expert keeps "
    "that order inside each expert.",
    "np.argsort(expert, kind='stable') groups by expert; counts before capacity are "
    "np.bincount(expert, minlength=num_experts). A choice's rank inside its expert is its position "
    "minus where its expert starts (np.cumsum(counts) - counts): keep it when that rank < capacity.",
    "combine: out = zeros((N, C)); np.add.at(out, slots // k, gates.reshape(-1)[slots][:, None] * y). "
    "Not out[slots // k] += ...: a token that appears twice in slots would be added only once.",
)

CASES = [  # (N, k, E, capacity, seed)
    (6, 1, 3, None, 0), (10, 2, 4, None, 1), (12, 2, 4, 3, 2), (9, 1, 5, 1, 3), (16, 2, 8, 2, 4),
    (8, 2, 3, 0, 5), (1, 2, 2, None, 6),
]


def _case(N, k, E, seed):
    rng = np.random.default_rng(seed)
    choices = np.stack([rng.choice(E - 1 if E > 2 else E, size=k, replace=False) for _ in range(N)])  # expert E-1 idle
    x = rng.standard_normal((N, 5))
    gates = rng.random((N, k))
    return x, choices, gates


def _reference_dispatch(x, choices, num_experts, capacity):
    from minitrain.nn.moe_dispatch import dispatch, plan_dispatch
    plan = plan_dispatch(choices, num_experts, capacity)
    return dispatch(x, plan), plan.counts, plan.slot


def _reference_combine(y, gates, slots):
    import minitrain as mt
    from minitrain.nn.moe_dispatch import combine
    plan = types.SimpleNamespace(slot=slots, num_tokens=gates.shape[0], top_k=gates.shape[1])
    return combine(mt.Tensor(y), mt.Tensor(gates), plan).data


def _describe(N, k, E, capacity):
    return f"dispatch(x of shape ({N}, 5), top-{k} choices, num_experts={E}, capacity={capacity})"


def _dispatch(impl):
    dispatch = impl[0]
    for N, k, E, capacity, seed in CASES:
        x, choices, _ = _case(N, k, E, seed)
        what = _describe(N, k, E, capacity)
        got = dispatch(to_learner(x), to_learner(choices), E, capacity)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise Mismatch(f"{what}: returned {type(got).__name__}, expected a tuple (rows, counts, slots)")
        rows, counts, slots = as_array(got[0], what + " rows"), host_all(got[1]), as_array(got[2], what + " slots")
        want_rows, want_counts, want_slots = _reference_dispatch(x, choices, E, capacity)
        try:
            counts = [int(c) for c in counts]
        except (TypeError, ValueError):
            raise Mismatch(f"{what}: counts is {counts!r:.60}, expected a list of {E} ints") from None
        if counts != list(want_counts):
            raise Mismatch(f"{what}: counts {counts}, expected {list(want_counts)} (choices per expert: "
                           f"{np.bincount(choices.reshape(-1), minlength=E).tolist()} before capacity; "
                           f"an expert keeps at most capacity)")
        problem = compare(slots, want_slots, what + " slots", exact=False, rtol=0, atol=0)
        if problem:
            raise Mismatch(problem + f" (choices = {choices.tolist()}: inside one expert, first choices of "
                           f"every token in token order come before second choices)")
        problem = compare(rows, want_rows, what + " rows", exact=True)
        if problem:
            raise Mismatch(problem + " (rows[m] must be x[slots[m] // k], the row of the token that made the choice)")


def _combine(impl):
    combine = impl[1]
    for N, k, E, capacity, seed in CASES:
        x, choices, gates = _case(N, k, E, seed)
        _, _, slots = _reference_dispatch(x, choices, E, capacity)
        y = np.random.default_rng(seed + 100).standard_normal((len(slots), 5))
        what = f"combine(y of shape {y.shape}, gates of shape ({N}, {k}), slots of {len(slots)}) after " \
               + _describe(N, k, E, capacity)
        got = as_array(combine(to_learner(y), to_learner(gates), to_learner(slots)), what)
        # the library's combine runs where tensors live (the GPU under MINITRAIN_DEVICE=cuda)
        want = host(_reference_combine(to_learner(y), to_learner(gates), to_learner(slots)))
        problem = compare(got, want, what)
        if problem:
            raise Mismatch(problem + " (out[t] is the sum over token t's kept choices j of gates[t, j] times "
                           "that choice's row of y; a token's k rows must all be added)")


def checks():
    return [Check("dispatch: rows, counts and slots, top-1 and top-2, with capacity", _dispatch, 1),
            Check("combine: the gate-weighted sum of each token's rows", _combine, 3)]


def reference():
    return _reference_dispatch, _reference_combine

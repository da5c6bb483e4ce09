"""Grader: the online softmax (Milakov & Gimelshein 2018) that makes ring attention exact: one block
folded from the empty state gives the row max, the sum of e^(S - m) and e^(S - m) V; blocks of keys
folded one at a time, in any split, give the softmax over all of them (float64, 1e-12 after each
fold); scores of +-1000 without overflow; masked (-inf) scores; and minitrain's ring attention, with
the learner's step inside, equal to full causal attention at cp = 2 and 3 (contiguous and zig-zag)."""
import math
from contextlib import contextmanager

import numpy as np

from ..comparing import as_array, compare, to_learner
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "the online softmax: ring attention's running max, sum and output, block by block"
ORDER = 198
KIND = "implement"
NOTEBOOK = "15_long_context"
DEFINES = "online_softmax_step"

STUB = '''"""Exercise online_softmax: ring attention (Liu et al. 2023) never holds a query's scores against
the whole sequence: the keys and values arrive one block at a time, round the ring. The online
softmax (Milakov & Gimelshein 2018; FlashAttention's trick) keeps, per query row, three running
quantities and folds each block of scores into them, so that at the end o / l is exactly
softmax(all scores) @ all values:
  m  the largest score seen so far,
  l  the sum of e^(score - m) over the keys seen so far,
  o  the sum of e^(score - m) * value over the keys seen so far.

Write online_softmax_step(m, l, o, s, v): fold one block into the running state.

Contract:
  - s is (..., rows, keys): this block's scores (already scaled; -inf where masked, but every row
    has at least one finite score); v is (..., keys, D): the block's values;
  - m and l are (..., rows, 1), o is (..., rows, D); the empty state is m = -inf, l = 0, o = 0;
  - return (m_new, l_new, o_new), new arrays: m_new the max of m and the block's row max; l and o
    were summed against e^(-m), so when the max rises to m_new they are rescaled by e^(m - m_new)
    before the block's own e^(s - m_new) terms are added;
  - never exponentiate a raw score: e^1000 overflows; e^(s - m_new) is at most 1.

The test to pass (float64):
  - one block from the empty state: m the row max, l = sum e^(s - m), o = e^(s - m) @ v;
  - blocks of several splits folded one at a time: m, l, o after each fold equal the same
    quantities over every key folded so far, and o / l equals softmax(all scores) @ values;
  - scores near +-1000, and blocks with masked (-inf) scores: finite and exact;
  - minitrain's ring attention with your step inside equals full causal attention at cp = 2, 3.

Check it:  python -m minitrain.exercises check online_softmax mine.py
Stuck?     python -m minitrain.exercises hint online_softmax
"""


def online_softmax_step(m, l, o, s, v):
    raise NotImplementedError("online_softmax_step: the new max, then rescale l and o, then add the block")
'''

HINTS = (
    "Start from one block and the empty state: m_new = max(m, s.max(axis=-1, keepdims=True)) is the row "
    "max; e = exp(s - m_new) is at most 1, so nothing overflows; l_new = e.sum(axis=-1, keepdims=True) and "
    "o_new = e @ v. With m = -inf, exp(m - m_new) = 0: the empty state drops out by itself.",
    "With a state already there, l and o are sums of exp(score - m) terms for the old m. When the max rises "
    "to m_new, each of those terms must become exp(score - m_new) = exp(score - m) * exp(m - m_new): multiply "
    "both l and o by correction = exp(m - m_new) (at most 1), then add the block's terms.",
    "xp-agnostic, in four lines: m_new = np.maximum(m, s.max(axis=-1, keepdims=True)); c = np.exp(m - m_new); "
    "e = np.exp(s - m_new); return m_new, l * c + e.sum(axis=-1, keepdims=True), o * c + e @ v. "
    "(np.maximum and np.exp work on CuPy arrays too.)",
)

SPLITS = [(8,), (3, 5), (1, 1, 6), (4, 4), (2, 3, 1, 2)]       # key blocks folded one at a time
ROWS, D = 3, 2


def _softmax_state(s, v):
    """m, l, o over these scores as one block: the truth after any split of them."""
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    return m, e.sum(axis=-1, keepdims=True), e @ v


def _empty(batch=(2,)):
    shape = batch + (ROWS, 1)
    return np.full(shape, -np.inf), np.zeros(shape), np.zeros(batch + (ROWS, D))


def _fold(impl, state, s, v, what):
    got = impl(*(to_learner(a) for a in state + (s, v)))
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise Mismatch(f"{what}: returned {type(got).__name__} {got!r:.60}, expected a tuple (m_new, l_new, o_new)")
    return tuple(as_array(a, f"{what}[{i}]") for i, a in enumerate(got))


def _expect(got, want, what, seen, folds, why=None):
    for name, g, w in zip("mlo", got, want):
        problem = compare(g, w, f"{what}: {name}_new", rtol=1e-12, atol=1e-12)
        if problem is None:
            continue
        if not np.all(np.isfinite(g[np.isfinite(w)])):
            problem += (" -- inf or nan where the truth is finite: a raw score was exponentiated (e^1000 "
                        "overflows); exponentiate s - m_new and m - m_new, both at most 0")
        elif why:
            problem += " -- " + why
        elif name == "m":
            problem += " -- m_new is the larger of m and the block's row max, s.max(axis=-1, keepdims=True)"
        elif folds == 1:
            problem += (f" -- from the empty state {name}_new is " + ("sum e^(s - m_new) over the keys" if name == "l"
                        else "e^(s - m_new) @ v") + ", with m_new the row max")
        else:
            problem += (f" -- after {folds} folds ({seen} keys) {name} must be the sum over every key folded so far "
                        f"against the new max: the old {name} was summed against e^(-m), so multiply it by "
                        "e^(m - m_new) before adding the block's terms")
        raise Mismatch(problem)


def _one_block(impl):
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal((2, ROWS, 8)), rng.standard_normal((2, 8, D))
    got = _fold(impl, _empty(), s, v, "online_softmax_step(empty state, one block of 8 keys)")
    _expect(got, _softmax_state(s, v), "online_softmax_step(empty state, one block of 8 keys)", 8, 1)


def _run_splits(impl, s, v, label):
    for split in SPLITS:
        state, at = _empty(), 0
        for b, n in enumerate(split):
            what = f"{label}, keys split {list(split)}: fold {b + 1} (keys {at}..{at + n - 1})"
            state = _fold(impl, state, s[..., at:at + n], v[..., at:at + n, :], what)
            at += n
            _expect(state, _softmax_state(s[..., :at], v[..., :at, :]), what, at, b + 1)
        m, l, o = state
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        problem = compare(o / l, (w / w.sum(axis=-1, keepdims=True)) @ v, f"{label}, split {list(split)}: o / l",
                          rtol=1e-12, atol=1e-12)
        if problem:
            raise Mismatch(problem + " -- o / l after the last fold must be softmax(all scores) @ values")


def _blocks(impl):
    rng = np.random.default_rng(2)
    s, v = 3 * rng.standard_normal((2, ROWS, 8)), rng.standard_normal((2, 8, D))
    s[..., 6:] += 4.0                              # the max rises in the late blocks: the rescaling matters
    _run_splits(impl, s, v, "scores rising along the keys")


def _large(impl):
    rng = np.random.default_rng(3)
    s, v = rng.uniform(995.0, 1005.0, (2, ROWS, 8)), rng.standard_normal((2, 8, D))
    s[1] -= 2000.0                                 # and near -1000: e^(s - m) must not underflow to 0 / 0
    _run_splits(impl, s, v, "scores near +1000 and -1000")


MASKED = ("a masked score is -inf so that its key gets e^(-inf - m_new) = 0, no weight at all; left as -inf it "
          "needs no special case (every row has a finite score in each block), and replacing it by any finite "
          "number gives the masked key a weight")


def _masked(impl):
    rng = np.random.default_rng(4)
    s, v = rng.standard_normal((2, ROWS, 8)), rng.standard_normal((2, 8, D))
    s[..., 5:] = np.where(np.triu(np.ones((ROWS, 3), bool), k=1), -np.inf, s[..., 5:])   # a causal diagonal block
    for split in [(5, 3), (2, 3, 3), (1, 4, 3)]:   # every block gives each row one finite score at least
        state, at = _empty(), 0
        for b, n in enumerate(split):
            what = f"masked scores (-inf), keys split {list(split)}: fold {b + 1} (keys {at}..{at + n - 1})"
            state = _fold(impl, state, s[..., at:at + n], v[..., at:at + n, :], what)
            at += n
            _expect(state, _softmax_state(s[..., :at], v[..., :at, :]), what, at, b + 1, MASKED)


@contextmanager
def _inside_ring_attention(impl):
    from ...parallel.context_parallel import ring
    library = ring.online_softmax_step
    ring.online_softmax_step = impl
    try:
        yield
    finally:
        ring.online_softmax_step = library


def _full_causal(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s = np.where(np.triu(np.ones(s.shape[-2:], bool), k=1), -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def _ring_rank(comm, layout):
    from ... import Tensor
    from ...parallel.context_parallel import positions_of, ring_attention
    p, T = comm.size, 4 * comm.size
    q, k, v = np.random.default_rng(10 + p).standard_normal((3, 1, 2, T, 3))
    mine = np.asarray(positions_of(T, p, comm.rank, layout))
    out = ring_attention(*(Tensor(to_learner(a[:, :, mine])) for a in (q, k, v)), comm, causal=True, layout=layout)
    problem = compare(as_array(out.data, "ring_attention"), _full_causal(q, k, v)[:, :, mine],
                      f"rank {comm.rank} of {p}, ring attention ({layout}) with your online_softmax_step",
                      rtol=1e-10, atol=1e-12)
    if problem:
        raise Mismatch(problem + " -- each ring step folds one block of keys into the running state; the "
                       "result must be full causal attention on this rank's queries")


def _ring(impl):
    with _inside_ring_attention(impl):
        for p in (2, 3):
            for layout in ("contiguous", "zigzag"):
                run_ranks(p, _ring_rank, layout)


def checks():
    return [Check("one block from the empty state: the row max, sum e^(s - m), e^(s - m) @ v", _one_block, 1),
            Check("blocks folded one at a time == the softmax over every key so far", _blocks, 2),
            Check("scores near +-1000: no overflow, no 0 / 0", _large, 1),
            Check("masked (-inf) scores", _masked, 2),
            Check("minitrain's ring attention with your step == full causal attention, cp = 2, 3", _ring, 3)]


def reference():
    from ...parallel.context_parallel.ring import online_softmax_step
    return online_softmax_step

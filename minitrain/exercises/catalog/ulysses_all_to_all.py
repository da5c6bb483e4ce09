"""Grader: DeepSpeed-Ulysses' two all-to-alls (Jacobs et al. 2023), sequence-sharded to head-sharded
and back, on minitrain.comm.all_to_all_single, at p = 1..4 against the gathered tensors: both
directions exactly (every element says its token, head and place, so a wrong one is named), causal
attention on the rank's heads between them equal to full attention, and each all-to-all sending
(cp-1)/cp of the shard (comm.stats)."""
import math

import numpy as np

from ..comparing import as_array, compare, to_learner
from ..grading import Mismatch
from ..oracles import traffic, world_checks

TITLE = "Ulysses' two all-to-alls: sequence-sharded to head-sharded around attention, and back"
ORDER = 196
KIND = "implement"
NOTEBOOK = "15_long_context"
DEFINES = ("seq_to_heads", "heads_to_seq")

STUB = '''"""Exercise ulysses_all_to_all: context parallelism with DeepSpeed-Ulysses (Jacobs et al. 2023).
Each of cp ranks holds T/cp consecutive tokens of the sequence (rank r: tokens r*T/cp .. (r+1)*T/cp - 1),
every head. Attention needs the whole sequence, but each head is independent: one all-to-all gives
every rank the whole sequence for H/cp of the heads, attention runs there, and a second all-to-all
brings each rank its own tokens back, all heads.

Write seq_to_heads(comm, x) and heads_to_seq(comm, y) with one call each of

    from minitrain.comm import all_to_all_single
    all_to_all_single(comm, a)   rows of a (axis 0) cut into cp equal blocks, block j sent to rank j;
                                 returns the blocks received, rank 0's first, this rank's own in its place

Contract (cp = comm.size, r = comm.rank, n = T/cp, H divisible by cp):
  - seq_to_heads: x is (n, H, D), this rank's tokens, every head; return (T, H/cp, D): every token
    of the sequence, in order, for heads r*H/cp .. (r+1)*H/cp - 1;
  - heads_to_seq: the inverse; y is (T, H/cp, D) as seq_to_heads returns it; return (n, H, D):
    this rank's tokens, every head, in order;
  - each sends (cp-1)/cp of its input to the other ranks and nothing more.

The test to pass, at p = 1, 2, 3, 4, float64 and float32, two shapes: both directions exactly against
the gathered tensors; causal attention computed on each rank's heads between the two equals full
attention; the bytes each all-to-all sends (comm.stats).

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check ulysses_all_to_all mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check ulysses_all_to_all mine.py
Stuck?     python -m minitrain.exercises hint ulysses_all_to_all
"""
from minitrain.comm import all_to_all_single


def seq_to_heads(comm, x):
    raise NotImplementedError("seq_to_heads: the whole sequence for this rank's heads")


def heads_to_seq(comm, y):
    raise NotImplementedError("heads_to_seq: this rank's tokens back, every head")
'''

HINTS = (
    "The all-to-all moves whole rows of axis 0, block j to rank j. So before it, make axis 0 run over "
    "the destination first: rank j must get all of your n tokens for its head group j. x.reshape(n, cp, "
    "H // cp, D) separates the head groups; which axis must come first?",
    "seq_to_heads: send = xp.ascontiguousarray(x.reshape(n, cp, H // cp, D).transpose(1, 0, 2, 3))"
    ".reshape(cp * n, H // cp, D). What comes back is rank 0's n tokens, then rank 1's, ...: already "
    "the whole sequence in order, shape (T, H/cp, D). Nothing to reorder on this side.",
    "heads_to_seq: all_to_all_single(comm, y) sends rows j*n .. (j+1)*n - 1 (rank j's tokens) to rank j; "
    "what comes back is (cp, n, H/cp, D), grouped by the sending rank, that is by head group. "
    "transpose(1, 0, 2, 3) before reshaping to (n, H, D), or head group g lands on the wrong heads.",
)

SHAPES = [(2, 1, 3), (3, 2, 2)]           # (tokens per rank, heads per rank, D)
DTYPES = ("float64", "float32")


def _full(T, H, D, dtype):
    """Every element tells where it belongs: 1000 * token + 10 * head + place in the head."""
    t, h, d = np.meshgrid(np.arange(T), np.arange(H), np.arange(D), indexing="ij")
    return (1000 * t + 10 * h + d).astype(dtype)


def _explain(problem, got, want):
    """compare()'s text plus which token and head the first wrong element came from."""
    wrong = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if wrong.size:
        g, w = int(got.reshape(-1)[wrong[0]]), int(want.reshape(-1)[wrong[0]])
        problem += (f": it holds token {g // 1000}, head {g % 1000 // 10}, where token {w // 1000}, "
                    f"head {w % 1000 // 10} belongs")
    return problem


def _call(fn, comm, a, what, want, rule):
    got = as_array(fn(comm, to_learner(a)), what)
    problem = compare(got, want, what, exact=True)
    if problem:
        raise Mismatch(_explain(problem, got.astype(np.float64), want.astype(np.float64)) + f" ({rule})")


def _to_heads(comm, impl):
    p, r = comm.size, comm.rank
    for n, h, D in SHAPES:
        for dtype in DTYPES:
            T, H = n * p, h * p
            full = _full(T, H, D, dtype)
            what = f"rank {r} of {p}, seq_to_heads(x of shape ({n}, {H}, {D}), {dtype})"
            want = full[:, r * h:(r + 1) * h]
            _call(impl[0], comm, full[r * n:(r + 1) * n], what, want,
                  f"seq_to_heads returns every token in sequence order, rank 0's first, for heads {r * h}..{(r + 1) * h - 1}")


def _to_seq(comm, impl):
    p, r = comm.size, comm.rank
    for n, h, D in SHAPES:
        for dtype in DTYPES:
            T, H = n * p, h * p
            full = _full(T, H, D, dtype)
            what = f"rank {r} of {p}, heads_to_seq(y of shape ({T}, {h}, {D}), {dtype})"
            _call(impl[1], comm, full[:, r * h:(r + 1) * h], what, full[r * n:(r + 1) * n],
                  "heads_to_seq returns this rank's tokens with every head in order: the block from rank j "
                  "is head group j of those tokens")


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v per head, key <= query; (T, H, D) arrays."""
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    s = np.where(np.triu(np.ones(s.shape[1:], bool), k=1), -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hts,shd->thd", w / w.sum(axis=-1, keepdims=True), v)


def _attention(comm, impl):
    p, r = comm.size, comm.rank
    n, h, D = 4, 2, 3
    T, H = n * p, h * p
    q, k, v = np.random.default_rng(p).standard_normal((3, T, H, D))
    mine = slice(r * n, (r + 1) * n)
    what = f"rank {r} of {p}, heads_to_seq(causal attention on seq_to_heads(q), (k), (v))"
    heads = [as_array(impl[0](comm, to_learner(a[mine])), f"rank {r} of {p}, seq_to_heads") for a in (q, k, v)]
    if heads[0].shape != (T, h, D):
        raise Mismatch(f"rank {r} of {p}, seq_to_heads(q of shape ({n}, {H}, {D})): shape {heads[0].shape}, "
                       f"expected ({T}, {h}, {D})")
    out = as_array(impl[1](comm, to_learner(causal_attention(*heads))), what)
    problem = compare(out, causal_attention(q, k, v)[mine], what)
    if problem:
        raise Mismatch(problem + " (attention on this rank's heads over the whole sequence, brought back to "
                       "its tokens, must equal full causal attention on its tokens)")


def _bytes(comm, impl):
    p, r = comm.size, comm.rank
    n, h, D = 3, 2, 4
    for i, (name, a) in enumerate([("seq_to_heads", np.ones((n, h * p, D))), ("heads_to_seq", np.ones((n * p, h, D)))]):
        sent, _ = traffic(comm, lambda: impl[i](comm, to_learner(a)))
        want = a.nbytes * (p - 1) // p
        if sent != want:
            raise Mismatch(f"rank {r} of {p}, {name}(input of shape {a.shape}, float64: {a.nbytes} bytes) sent "
                           f"{sent} bytes; one all-to-all sends (cp-1)/cp of its input, {want} bytes (a block of "
                           f"1/cp to each other rank; its own block stays here)"
                           + (": gathering everything moves cp-1 times the shard" if sent > want else ""))


def checks():
    return world_checks([("seq_to_heads: the whole sequence, this rank's heads", _to_heads, 1, 1),
                         ("heads_to_seq: this rank's tokens back, every head", _to_seq, 3, 1),
                         ("attention on the rank's heads between them equals full attention", _attention, 2, 1),
                         ("each all-to-all sends (cp-1)/cp of its input", _bytes, 2, 2)])


def _reference_to_heads(comm, x):
    from minitrain.backend import array_module
    from minitrain.comm import all_to_all_single
    xp, (n, H, D), p = array_module(x), x.shape, comm.size
    send = xp.ascontiguousarray(x.reshape(n, p, H // p, D).transpose(1, 0, 2, 3)).reshape(p * n, H // p, D)
    return all_to_all_single(comm, send)


def _reference_to_seq(comm, y):
    from minitrain.backend import array_module
    from minitrain.comm import all_to_all_single
    xp, (T, h, D), p = array_module(y), y.shape, comm.size
    back = all_to_all_single(comm, xp.ascontiguousarray(y)).reshape(p, T // p, h, D)
    return xp.ascontiguousarray(back.transpose(1, 0, 2, 3)).reshape(T // p, p * h, D)


def reference():
    return _reference_to_heads, _reference_to_seq

"""Grader: ring attention's zig-zag split (Llama 3, Dubey et al. 2024, sec. 3.3.2): every position
held by exactly one rank; the causal work per rank (query-key pairs with key <= query) within 5% of
the mean, where the contiguous split's last rank does the most (2P/(P+1) times the mean in blocks
of T/P); the exact order (chunk r, then chunk 2cp-1-r); a length that does not cut into 2cp chunks
refused."""
import numpy as np

from ..comparing import host_all
from ..grading import Check, Mismatch
from ..oracles import causal_blocks, causal_pairs, zigzag_indices

TITLE = "the zig-zag split: which tokens each rank holds so that causal attention's work is even"
ORDER = 197
KIND = "implement"
NOTEBOOK = "15_long_context"
DEFINES = "zigzag_indices"
TOLERANCE = 0.05            # the causal work of every rank within 5% of the mean

STUB = '''"""Exercise zigzag_split: context parallelism cuts a sequence of T tokens over cp ranks. With a
causal mask the query at position q attends to q+1 keys, so the work is a triangle: cut into cp
contiguous pieces, the last rank computes the most and the others wait for it. Ring attention's
zig-zag split (Llama 3, Dubey et al. 2024, sec. 3.3.2) cuts the sequence into 2*cp chunks and gives
rank r two of them, chunk r and chunk 2*cp-1-r: an early chunk (little work) paired with a late one
(much work), so every rank gets the same amount.

Write zigzag_indices(seq_len, cp, rank): the token positions rank `rank` of `cp` holds.

Contract:
  - seq_len = T tokens, positions 0 .. T-1; chunk i is positions i*c .. (i+1)*c - 1, c = T / (2*cp);
  - return a 1-D integer array: the positions of chunk rank, then those of chunk 2*cp-1-rank, each
    in increasing order (this is the rank's local sequence, in the order its attention sees it);
  - when T does not cut into 2*cp equal chunks, raise ValueError with one line saying so.

The test to pass, for several T and cp = 1 .. 8:
  - every position 0 .. T-1 is held by exactly one rank;
  - the causal work of every rank, the (query, key) pairs with key <= query over its positions,
    is within 5% of the mean (a contiguous split gives every rank T/cp tokens and still fails);
  - the positions in exactly the order above;
  - zigzag_indices(10, 2, 0) raises ValueError (10 tokens do not cut into 4 chunks).

Check it:  python -m minitrain.exercises check zigzag_split mine.py
Stuck?     python -m minitrain.exercises hint zigzag_split
"""
import numpy as np


def zigzag_indices(seq_len, cp, rank):
    raise NotImplementedError("zigzag_indices: chunk rank, then chunk 2*cp-1-rank")
'''

HINTS = (
    "Count the work: a query at position q attends to q+1 keys, so with chunks of c tokens chunk i "
    "costs about c*c*i + c*(c+1)/2 pairs. Chunks i and 2cp-1-i together cost c*c*(2cp-1) + c*(c+1), "
    "the same for every i: that is why each rank takes one early chunk and its mirror image.",
    "First refuse what cannot be cut: if seq_len % (2 * cp): raise ValueError(...). Then "
    "c = seq_len // (2 * cp); chunk i is np.arange(i * c, (i + 1) * c).",
    "return np.concatenate([np.arange(rank * c, (rank + 1) * c), "
    "np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]): chunk rank, then chunk 2*cp-1-rank.",
)

COVER = [(8, 2), (2, 1), (12, 3), (16, 4), (8, 4), (48, 4), (32, 8)]        # (T, cp)
BALANCE = [(16, 2), (24, 3), (64, 4), (48, 6), (128, 8)]
ORDERED = COVER + BALANCE
REFUSED = [(10, 2), (12, 4), (3, 1), (6, 4)]


def _held(impl, T, cp, r):
    """Rank r's positions as a 1-D int64 array, or a Mismatch saying what came back instead."""
    what = f"zigzag_indices({T}, {cp}, {r})"
    got = host_all(impl(T, cp, r))
    try:
        a = np.asarray(got)
    except (TypeError, ValueError):
        a = None
    if a is None or a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        shown = f"{type(got).__name__} {got!r:.60}"
        raise Mismatch(f"{what}: returned {shown}, expected a 1-D array of integer positions")
    return a.astype(np.int64)


def _positions(i, c):
    return f"position {i * c}" if c == 1 else f"positions {i * c}..{(i + 1) * c - 1}"


def _split(impl, T, cp):
    return [_held(impl, T, cp, r) for r in range(cp)]


def _cover(impl):
    for T, cp in COVER:
        held = _split(impl, T, cp)
        c = T // (2 * cp)
        chunks = (f" (with 2*cp = {2 * cp} chunks of c = {c} tokens, chunk i is positions i*c .. (i+1)*c - 1; "
                  f"the last one is chunk 2*cp-1 = {2 * cp - 1})")
        for r, a in enumerate(held):
            outside = a[(a < 0) | (a >= T)]
            if outside.size:
                raise Mismatch(f"zigzag_indices({T}, {cp}, {r}) holds position {outside[0]}, outside the sequence "
                               f"(T = {T}: positions 0..{T - 1})" + chunks)
        count = np.bincount(np.concatenate(held), minlength=T)
        for q in range(T):
            if count[q] != 1:
                owners = [r for r, a in enumerate(held) if q in a]
                raise Mismatch(f"T = {T}, cp = {cp}: position {q} is held by {count[q]} ranks"
                               + (f" ({owners})" if owners else "") + "; every position must be held exactly once"
                               + chunks)


def _why_contiguous(held, T, cp):
    """The contiguous split's story, told when that is what the hand-in returned."""
    n = T // cp
    if not all(np.array_equal(a, np.arange(r * n, (r + 1) * n)) for r, a in enumerate(held)):
        return ("Holding the same number of tokens is not enough: a query at position q attends to q+1 keys, "
                "so late positions cost more than early ones")
    blocks = [causal_blocks(a, T, cp) for a in held]
    return (f"This is the contiguous split: every rank holds T/cp = {n} tokens, the same count, but causal "
            f"attention is a triangle. In blocks of T/cp tokens (ring attention's unit) rank r computes r+1 "
            f"of them: {blocks}, max/mean = 2P/(P+1) = {2 * cp / (cp + 1):.3g} at P = cp = {cp}, and every "
            f"step waits for the last rank. Cut into 2*cp chunks and give each rank an early one and a late one")


def _balance(impl):
    for T, cp in BALANCE:
        held = _split(impl, T, cp)
        work = [causal_pairs(a) for a in held]
        mean = sum(work) / cp
        if max(work) > (1 + TOLERANCE) * mean or min(work) < (1 - TOLERANCE) * mean:
            raise Mismatch(f"T = {T}, cp = {cp}: the causal work per rank (query-key pairs with key <= query) is "
                           f"{work}: max/mean = {max(work) / mean:.3g}, min/mean = {min(work) / mean:.3g}, "
                           f"not within {TOLERANCE:.0%} of the mean. " + _why_contiguous(held, T, cp))


def _order(impl):
    for T, cp in ORDERED:
        for r in range(cp):
            got, want = _held(impl, T, cp, r), zigzag_indices(T, cp, r)
            if not np.array_equal(got, want):
                c = T // (2 * cp)
                same = sorted(got.tolist()) == sorted(want.tolist())
                raise Mismatch(f"zigzag_indices({T}, {cp}, {r}) is {got.tolist()}, expected {want.tolist()}: "
                               + ("the right positions in another order; " if same else "")
                               + f"chunk r = {r} ({_positions(r, c)}) first, then chunk "
                               f"2*cp-1-r = {2 * cp - 1 - r}, each in increasing order (the rank's local "
                               "sequence is these positions in this order: its causal mask and the loss's "
                               "targets follow it)")


def _refused(impl):
    for T, cp in REFUSED:
        try:
            got = impl(T, cp, 0)
        except ValueError:
            continue
        raise Mismatch(f"zigzag_indices({T}, {cp}, 0) returned {host_all(got)!r:.80} instead of raising "
                       f"ValueError: {T} tokens do not split into 2*cp = {2 * cp} equal chunks, and a silent "
                       "T // (2*cp) would leave tokens on no rank")


def checks():
    return [Check("every position held by exactly one rank", _cover, 1),
            Check("the causal work of every rank within 5% of the mean", _balance, 1),
            Check("the exact order: chunk r, then chunk 2cp-1-r", _order, 3),
            Check("a length that does not split into 2cp chunks is refused (ValueError)", _refused, 2)]


def reference():
    return zigzag_indices

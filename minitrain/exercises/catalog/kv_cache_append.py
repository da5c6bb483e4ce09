"""Grader: the contiguous KV cache's step (Pope et al. 2022, sec. 3.1; Kwon et al. 2023, Fig. 2: each
sequence's keys and values in a region reserved for it): a forward's new tokens' keys and values
written at their positions in their sequence's slot, and what those tokens attend to returned, with
the mask that hides later positions and a shorter sequence's padding; minitrain's GPT generating
through the learner's step gives the logits of a plain forward (float64, 1e-10)."""
import numpy as np

from ..comparing import host, to_learner
from ..grading import Check, Mismatch

TITLE = "the KV cache's step: the new tokens' keys and values stored, and what they attend to"
ORDER = 186
KIND = "implement"
NOTEBOOK = "11_inference"
DEFINES = "kv_append"

STUB = '''"""Exercise kv_cache_append: a GPT generates one token at a time, and token t's keys and values never
change once computed, so a KV cache keeps them: each new token then costs one row of attention against
the cache instead of a forward over the whole prefix again (Pope et al. 2022, "Efficiently Scaling
Transformer Inference", sec. 3.1). The contiguous cache reserves, per sequence, a slot of max_len
positions in one layer's store, for keys and for values alike.

Write kv_append(k_store, v_store, rows, starts, k, v), one layer's step of a forward that feeds T new
tokens to each of B sequences (a batch row each).

Contract:
  - k_store and v_store are the layer's cache, shape (slots, H, max_len, D): the key of the token at
    position p of the sequence in slot s is k_store[s, :, p] (its H heads);
  - rows[b] is the slot of batch row b's sequence and starts[b] how many tokens it holds already (both
    lists of Python ints: the cache's bookkeeping lives on the host);
  - k and v are the new tokens' keys and values, shape (B, H, T, D): row b's token i sits at position
    starts[b] + i. Write them there, in place; leave every other position of the stores as it was;
  - return (keys, values, mask): keys and values of shape (B, H, L, D), L = max(starts) + T (the longest
    sequence after this step), row b's the first L positions of its slot; mask of shape (B, 1, T, L),
    booleans, True where row b's new token i may not look: key position j > starts[b] + i (a later
    token, or past the end of a sequence shorter than the longest: its padding).
  - arrays live where the stores do (NumPy on the CPU, CuPy on the GPU): make the mask with the stores'
    array module.

The test to pass:
  - one sequence, a prompt then tokens one and three at a time: the stores after each step hold every
    key and value at its position in the sequence's slot, nothing else changed;
  - keys, values and mask as above, for B = 1 and for three sequences of different lengths in slots
    other than their batch rows;
  - minitrain's GPT (float64) generating through your kv_append, sequences of different lengths in one
    batch, gives the logits of a plain forward over each whole sequence (1e-10).

Check it:  python -m minitrain.exercises check kv_cache_append mine.py
Stuck?     python -m minitrain.exercises hint kv_cache_append
"""


def kv_append(k_store, v_store, rows, starts, k, v):
    raise NotImplementedError("kv_append: write the new keys and values, return what the new tokens attend to")
'''

HINTS = (
    "Loop over the batch rows: row b's sequence lives in slot rows[b], and its T new tokens go to positions "
    "starts[b] .. starts[b] + T - 1 of that slot. k[b] is (H, T, D), exactly the shape of "
    "k_store[rows[b], :, starts[b]:starts[b] + T]. Never slot b: the batch row is not the slot.",
    "What the new tokens attend to: L = max(starts) + T positions of every row's slot, so that the rows stack "
    "into one (B, H, L, D) array: xp.stack([k_store[rows[b], :, :L] for b in range(B)]), with xp the stores' "
    "array module (minitrain.backend.array_module(k_store)). A shorter sequence's positions past its own end "
    "hold whatever the slot held before: the mask must hide them.",
    "The mask: new token i of row b is at position q = starts[b] + i and may look at keys 0 .. q, not at j > q "
    "(strictly greater: a token attends to itself). With xp: mask[b, 0] = xp.arange(L)[None, :] > (starts[b] + "
    "xp.arange(T))[:, None], in an xp.zeros((B, 1, T, L), bool) array.",
)

PROMPT_THEN_TOKENS = (5, 1, 3)          # one sequence: a prompt of 5, then 1 token, then 3 at once


def _store(slots, h, max_len, d, seed):
    return np.random.default_rng(seed).standard_normal((slots, h, max_len, d))


def _call(impl, k_store, v_store, rows, starts, k, v):
    """impl's step on the learner's device; its (keys, values, mask) on the host, checked for shape."""
    ks, vs = to_learner(k_store), to_learner(v_store)
    what = f"kv_append(stores {k_store.shape}, rows={rows}, starts={starts}, new keys and values {k.shape})"
    got = impl(ks, vs, list(rows), list(starts), to_learner(k), to_learner(v))
    if not isinstance(got, tuple) or len(got) != 3:
        raise Mismatch(f"{what} returned {type(got).__name__}, expected a tuple (keys, values, mask)")
    keys, values, mask = (host(a) for a in got)
    B, H, T, D = k.shape
    L = max(starts) + T
    for name, a, shape in (("keys", keys, (B, H, L, D)), ("values", values, (B, H, L, D)), ("mask", mask, (B, 1, T, L))):
        if tuple(np.shape(a)) != shape:
            whole = np.ndim(a) == len(shape) and np.shape(a)[shape.index(L, 2)] == k_store.shape[2] != L
            why = (f": L = max(starts) + T = {max(starts)} + {T} = {L}, the longest sequence after this step, not the "
                   f"slot's max_len {k_store.shape[2]} (attention would read {k_store.shape[2] - L} positions no "
                   "token of the batch holds)" if whole else "")
            raise Mismatch(f"{what}: {name} has shape {tuple(np.shape(a))}, expected {shape}{why}")
    return host(ks), host(vs), keys, values, mask, what


def _expected(k_store, v_store, rows, starts, k, v):
    """The stores after the step and what it returns, written out plainly."""
    ks, vs = k_store.copy(), v_store.copy()
    B, H, T, D = k.shape
    for b in range(B):
        ks[rows[b], :, starts[b]:starts[b] + T], vs[rows[b], :, starts[b]:starts[b] + T] = k[b], v[b]
    L = max(starts) + T
    mask = np.arange(L)[None, None, :] > (np.array(starts)[:, None] + np.arange(T))[:, :, None]
    return ks, vs, ks[list(rows), :, :L], vs[list(rows), :, :L], mask[:, None]


def _expect_stores(got, want, rows, starts, T, what):
    for name, g, w in (("k_store", got[0], want[0]), ("v_store", got[1], want[1])):
        wrong = np.argwhere(g != w)
        if len(wrong):
            s, _, p, _ = wrong[0]
            owner = [b for b in range(len(rows)) if rows[b] == s]
            if owner and starts[owner[0]] <= p < starts[owner[0]] + T:
                why = (f"it should hold row {owner[0]}'s new token {p - starts[owner[0]]} (slot rows[{owner[0]}] = {s}, "
                       f"position starts[{owner[0]}] + {p - starts[owner[0]]} = {p})")
            else:
                why = ("no new token goes there, and it changed: row b's tokens go to slot rows[b] (not slot b), at "
                       "positions starts[b] .. starts[b] + T - 1 (not from 0)")
            raise Mismatch(f"after {what}: {name}[{s}, :, {p}] (slot {s}, position {p}) is wrong: {why}")


def _expect_returned(got, want, rows, starts, what):
    keys, values, mask = got[2:5]
    for name, g, w in (("keys", keys, want[2]), ("values", values, want[3])):
        wrong = np.argwhere(g != w)
        if len(wrong):
            b, _, j, _ = wrong[0]
            raise Mismatch(f"{what}: {name}[{b}, :, {j}] is not position {j} of slot rows[{b}] = {rows[b]} after the "
                           f"write: row b attends to its own slot's first L positions, the new tokens included")
    if mask.dtype != np.bool_:
        raise Mismatch(f"{what}: the mask's dtype is {mask.dtype}, expected bool (True: may not look)")
    wrong = np.argwhere(mask != want[4])
    if len(wrong):
        b, _, i, j = wrong[0]
        q = starts[b] + i
        say = "hides" if mask[b, 0, i, j] else "shows"
        reason = ("itself: a token attends to its own key" if j == q else
                  "an earlier position" if j < q else
                  f"position {j}, later than the token's own {q}" + (
                      f" and past the end of row {b}'s sequence ({starts[b] + mask.shape[2]} tokens): its padding"
                      if j >= starts[b] + mask.shape[2] else ""))
        raise Mismatch(f"{what}: mask[{b}, 0, {i}, {j}] {say} key {j} from row {b}'s new token {i} (position "
                       f"starts[{b}] + {i} = {q}), which is {reason}: True exactly where j > starts[b] + i")


def _one_sequence(impl, check_returned):
    H, D = 2, 3
    k_store, v_store = _store(3, H, 12, D, 0), _store(3, H, 12, D, 1)
    rng, start = np.random.default_rng(2), 0
    for T in PROMPT_THEN_TOKENS:
        k, v = rng.standard_normal((1, H, T, D)), rng.standard_normal((1, H, T, D))
        want = _expected(k_store, v_store, [1], [start], k, v)
        got = _call(impl, k_store, v_store, [1], [start], k, v)
        _expect_stores(got, want, [1], [start], T, got[-1])
        if check_returned:
            _expect_returned(got, want, [1], [start], got[-1])
        k_store, v_store, start = want[0], want[1], start + T


def _written(impl):
    _one_sequence(impl, check_returned=False)


def _returned(impl):
    _one_sequence(impl, check_returned=True)


def _ragged(impl):
    H, D, T = 2, 3, 2
    k_store, v_store = _store(4, H, 10, D, 3), _store(4, H, 10, D, 4)
    rows, starts = [2, 0, 3], [1, 6, 0]
    rng = np.random.default_rng(5)
    k, v = rng.standard_normal((3, H, T, D)), rng.standard_normal((3, H, T, D))
    want = _expected(k_store, v_store, rows, starts, k, v)
    got = _call(impl, k_store, v_store, rows, starts, k, v)
    _expect_stores(got, want, rows, starts, T, got[-1])
    _expect_returned(got, want, rows, starts, got[-1])


def _learners_cache(impl, model, num_slots):
    from ...nn.generation import ContiguousKVCache

    class LearnersCache(ContiguousKVCache):
        """The library's contiguous cache (slots, lengths, positions, the ledger), with the learner's step."""

        def _prepare(self, starts, num_new):
            super()._prepare(starts, num_new)         # (the bounds check)
            self.host_rows, self.host_starts = [self.slot[s] for s in self.batch], [int(s) for s in starts]

        def append(self, layer, k, v):
            return impl(self.k[layer], self.v[layer], self.host_rows, self.host_starts, k, v)

    return LearnersCache.for_model(model, num_slots)


def _generates_exactly(impl):
    from ... import manual_seed, nn
    manual_seed(4)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=24, n_layer=2, n_head=2, n_embd=8))
    model.to(np.float64)
    cache = _learners_cache(impl, model, num_slots=3)
    rng = np.random.default_rng(6)
    tokens = {s: list(rng.integers(0, 13, n)) for s, n in ((0, 7), (1, 2), (2, 4))}
    for s in (0, 1, 2):
        cache.add_sequence(s)
    cache.free_sequence(0)
    cache.add_sequence(0)                          # slots no longer in batch order
    fed = {s: [] for s in tokens}

    def forward(seqs, new):
        held = [len(fed[s]) for s in seqs]
        cache.select(seqs)
        logits = host(model(to_learner(np.array([new[s] for s in seqs])), cache=cache).data)
        for row, s in enumerate(seqs):
            fed[s] += new[s]
            want = host(model(to_learner(np.array([fed[s]]))).data)[0, -len(new[s]):]
            worst = float(np.abs(logits[row] - want).max())
            if not worst < 1e-10:
                raise Mismatch(f"a batch of sequences {seqs} holding {held} tokens, "
                               f"fed {len(new[s])} new each: row {row}'s logits differ from a plain forward over its "
                               f"whole sequence by {worst:.3g}: a key or value read from the wrong slot or position, "
                               "or the mask showing a later position or another row's padding")
    for s in (0, 1, 2):
        forward([s], {s: tokens[s]})               # each prompt alone
    for step in range(3):                          # then one token each, together: lengths 7, 2, 4 and on
        forward([1, 2, 0], {s: [int(rng.integers(0, 13))] for s in tokens})
    cache.release()


def checks():
    return [Check("the new tokens' keys and values written at their positions in their sequence's slot", _written, 1),
            Check("what they attend to: the slots' first L positions, and the causal mask", _returned, 2),
            Check("sequences of different lengths in other slots: each row's own positions, its padding hidden",
                  _ragged, 3),
            Check("minitrain's GPT generating through your kv_append: the logits of a plain forward", _generates_exactly,
                  2)]


def reference():
    """The library's ContiguousKVCache.append, on the given stores (a one-layer cache viewing them)."""
    from ... import backend
    from ...nn.generation import ContiguousKVCache

    def kv_append(k_store, v_store, rows, starts, k, v):
        slots, h, max_len, d = k_store.shape
        cache = ContiguousKVCache(1, h, d, 1, 1, k_store.dtype, backend.array_module(k_store))
        cache.k, cache.v, cache.max_len = k_store[None], v_store[None], max_len
        cache.slot, cache.batch = dict(enumerate(rows)), list(range(len(rows)))
        cache._prepare(np.array(starts, np.int64), k.shape[2])
        return cache.append(0, k, v)
    return kv_append

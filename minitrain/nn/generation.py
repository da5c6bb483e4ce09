"""Autoregressive generation: the KV-cache protocol attention reads through, the contiguous cache,
sampling, and the loop behind GPT.generate.

Token t's keys and values never change once computed, so a KV cache keeps them and each new token
costs one row of attention against the cache instead of a forward over the whole prefix again.
Memory: 2 · n_layer · n_embd · itemsize bytes per token (K and V in every layer; per rank under
tensor parallelism, n_embd / tp). ContiguousKVCache reserves max_len tokens per sequence when
the sequence starts (the static reservation of Kwon et al. 2023, sec. 3, Fig. 2): (max_len - length)
tokens of it are waste until the sequence ends. vLLM's paged cache (minitrain/inference/) plugs into
the same protocol; nn never imports it (the layering rule: inference/ sits beside nn/, above it).
"""
import weakref

import numpy as np

from .. import backend, memory
from ..autograd import Tensor, no_grad


def release_entries(tracker, keys):
    """Give back ledger entries still held (a cache collected without ``release()``)."""
    for key in list(keys):
        tracker.remove(key)
    keys.clear()


class KVCache:
    """What attention asks of a cache (``CausalSelfAttention.forward(x, cache, layer)``). A cache holds
    sequences by id; ``select(ids)`` picks the ones the next forward feeds, one batch row each. Then:

    * ``positions(num_new)`` -> (B, num_new) ints: make room for ``num_new`` new tokens per sequence
      (a paged cache allocates blocks here) and say at which positions they sit (GPT: ``wpe``);
    * ``append(layer, k, v)`` -> ``(keys, values, mask)``: store this layer's K/V of the new tokens,
      (B, H, num_new, D), and return all each sequence attends to: keys and values (B, H, L, D) and a
      boolean mask (B, 1, num_new, L), True where a query may not look (a later position, or padding
      past a sequence's length, which the sequences of a batch need when their lengths differ);
    * ``advance(num_new)``: after the last layer, the new tokens belong to the sequences.

    Subclasses provide storage (``_make_room``, ``_prepare``, ``append``, ``free_sequence``) and the
    accounting the serving job prints: ``reserved_bytes()`` (held for sequences) and ``used_bytes()``
    (holding some token's K/V). Host bookkeeping (lengths, tables) stays on the host; what attention
    needs on the device (positions, indices, mask) is copied there once per forward, on purpose."""

    def __init__(self, n_layer, n_head, head_dim, dtype, xp=np):
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self.dtype, self.xp = np.dtype(dtype), xp
        self.bytes_per_token = 2 * n_layer * n_head * head_dim * self.dtype.itemsize
        self.lengths = {}          # sequence id -> tokens whose K/V are stored
        self.batch = []            # the ids the next forward feeds, in row order
        self.tracker = memory.tracker()

    def select(self, seq_ids):
        missing = [s for s in seq_ids if s not in self.lengths]
        if missing:
            raise KeyError(f"{type(self).__name__}: sequences {missing} are not in the cache")
        self.batch = list(seq_ids)

    def positions(self, num_new):
        if not self.batch:
            raise RuntimeError("select() the sequences to feed before the forward")
        self._make_room(num_new)
        starts = np.array([self.lengths[s] for s in self.batch], dtype=np.int64)
        positions = starts[:, None] + np.arange(num_new)
        self._prepare(starts, num_new)
        return self._on_device(positions)

    def advance(self, num_new):
        for s in self.batch:
            self.lengths[s] += num_new

    def release(self):
        """Free every sequence's memory (generation is over)."""
        for s in list(self.lengths):
            self.free_sequence(s)

    # ---- helpers for subclasses
    def _make_room(self, num_new):
        pass

    def _mask(self, starts, num_new, width):
        """(B, 1, num_new, width): key j is hidden from the i-th new token of row b if j > starts[b] + i."""
        query = starts[:, None] + np.arange(num_new)                        # (B, T)
        return self._on_device((np.arange(width)[None, None, :] > query[:, :, None])[:, None])

    def _on_device(self, a):
        """A host array where the cache lives (on a GPU: one deliberate, counted copy)."""
        return a if self.xp is np else backend.to_device(a, "cuda")

    def tokens_held(self):
        return sum(self.lengths.values())


class ContiguousKVCache(KVCache):
    """K and V of ``num_slots`` sequences, each in its own contiguous (H, max_len, D) region per layer:
    (n_layer, num_slots, H, max_len, D) twice. ``add_sequence`` reserves a slot's max_len tokens in the
    memory ledger (category ``kv_cache``; the teaching device may refuse), ``free_sequence`` returns it."""

    def __init__(self, n_layer, n_head, head_dim, num_slots, max_len, dtype, xp=np):
        super().__init__(n_layer, n_head, head_dim, dtype, xp)
        if max_len < 1 or num_slots < 1:
            raise ValueError(f"a contiguous cache needs max_len >= 1 and num_slots >= 1, got {max_len}, {num_slots}")
        self.num_slots, self.max_len = num_slots, max_len
        shape = (n_layer, num_slots, n_head, max_len, head_dim)
        self.k, self.v = xp.zeros(shape, self.dtype), xp.zeros(shape, self.dtype)
        self.reservation_bytes = max_len * self.bytes_per_token
        self.slot = {}                                    # sequence id -> slot
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._keys = set()                                # ledger entries held (released if collected)
        weakref.finalize(self, release_entries, self.tracker, self._keys)

    @classmethod
    def for_model(cls, model, num_slots, max_len=None):
        """A cache shaped for ``model`` (a GPT, or its tensor-parallel form: this rank's heads)."""
        attn, w = model.h[0].attn, model.wpe.weight.data
        return cls(len(model.h), attn.n_head, attn.head_dim, num_slots, max_len or model.config.block_size,
                   w.dtype, backend.array_module(w))

    def can_add(self):
        free = self.tracker.free_bytes()
        return bool(self._free_slots) and (free is None or free >= self.reservation_bytes)

    def add_sequence(self, seq_id):
        if seq_id in self.slot:
            raise KeyError(f"sequence {seq_id} is already in the cache")
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} slots of the contiguous cache are taken")
        self.tracker.add("kv_cache", ("kv_cache", id(self), seq_id), self.reservation_bytes)
        self._keys.add(("kv_cache", id(self), seq_id))
        self.slot[seq_id] = self._free_slots.pop()
        self.lengths[seq_id] = 0

    def free_sequence(self, seq_id):
        self.tracker.remove(("kv_cache", id(self), seq_id))
        self._keys.discard(("kv_cache", id(self), seq_id))
        self._free_slots.append(self.slot.pop(seq_id))
        del self.lengths[seq_id]
        self.batch = [s for s in self.batch if s != seq_id]

    def _prepare(self, starts, num_new):
        ends = starts + num_new
        if ends.max() > self.max_len:
            raise ValueError(f"sequences would reach {int(ends.max())} tokens, past the cache's max_len {self.max_len}")
        rows = np.array([self.slot[s] for s in self.batch])
        self._rows = self._on_device(rows)
        self._write_rows = self._on_device(np.repeat(rows, num_new))
        self._write_cols = self._on_device((starts[:, None] + np.arange(num_new)).reshape(-1))
        self._width = int(ends.max())
        self._mask_now = self._mask(starts, num_new, self._width)

    def append(self, layer, k, v):
        B, H, T, D = k.shape
        for store, new in ((self.k[layer], k), (self.v[layer], v)):       # (slots, H, max_len, D)
            store[self._write_rows, :, self._write_cols] = new.transpose(0, 2, 1, 3).reshape(B * T, H, D)
        width = self._width
        return self.k[layer][self._rows, :, :width], self.v[layer][self._rows, :, :width], self._mask_now

    def reserved_bytes(self):
        return len(self.slot) * self.reservation_bytes

    def used_bytes(self):
        return self.tokens_held() * self.bytes_per_token


def sample(logits, temperature=1.0, top_k=None, rng=None):
    """One token from a row of host logits: the argmax when ``temperature`` is 0 (greedy), else one
    draw of ``rng`` from softmax(logits / temperature) over the ``top_k`` largest (nanoGPT's rule)."""
    if temperature == 0:
        return int(np.argmax(logits))
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    z = np.asarray(logits, dtype=np.float64)
    if top_k is not None:
        z = np.where(z < np.sort(z)[-min(top_k, z.size)], -np.inf, z)
    with np.errstate(over="ignore"):       # shifted before dividing: a tiny temperature gives -inf, never inf - inf
        z = (z - z.max()) / temperature
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, rng=None, cache="contiguous"):
    """``GPT.generate``: ``max_new_tokens`` tokens after each row of ``idx`` (B, T), drawn row by row from
    ``rng`` at every step. ``cache``: "contiguous" (default), None (recompute the prefix every token)
    or a ``KVCache`` holding B empty sequences (a paged one from minitrain.inference). A learned
    position embedding ends at the context (``block_size``): once a sequence outgrows it, each token
    is computed from the last block_size tokens without the cache, exactly as with ``cache=None``."""
    rng = rng or np.random.default_rng(0)
    idx = backend.to_host(idx.data if isinstance(idx, Tensor) else idx)
    if idx.ndim != 2 or 0 in idx.shape or not (backend.is_int(max_new_tokens) and max_new_tokens >= 0):
        raise ValueError(f"generate takes idx of shape (B, T), B and T >= 1, and max_new_tokens an integer >= 0; got "
                         f"shape {idx.shape} and {max_new_tokens!r}")
    B, context = idx.shape[0], model.config.block_size
    if isinstance(cache, str):
        if cache != "contiguous":
            raise ValueError(f"cache must be 'contiguous', None or a KVCache, got {cache!r}")
        cache = ContiguousKVCache.for_model(model, B)
        for s in range(B):
            cache.add_sequence(s)
    if cache is not None:
        if not isinstance(cache, KVCache) or len(cache.lengths) != B or cache.tokens_held():
            raise ValueError(f"generate needs a KVCache holding {B} empty sequences")
        ids = list(cache.lengths)
    was_training = model.training
    model.eval()
    fed = 0                                                    # tokens of idx already in the cache
    try:
        with no_grad():
            for _ in range(max_new_tokens):
                if cache is not None and idx.shape[1] > context:
                    cache.release()
                    cache = None
                if cache is None:
                    logits = model(backend.to_device(idx[:, -context:]))
                else:
                    cache.select(ids)
                    logits = model(backend.to_device(idx[:, fed:]), cache=cache)
                    fed = idx.shape[1]
                last = backend.to_host(logits.data[:, -1, :]).astype(np.float64)   # one copy per token
                nxt = np.array([[sample(row, temperature, top_k, rng)] for row in last], dtype=idx.dtype)
                idx = np.concatenate([idx, nxt], axis=1)
    finally:
        if cache is not None:
            cache.release()
        model.train(was_training)
    return idx

"""The paged KV cache (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", sec. 4, Figs. 5-8): K/V live in fixed-size blocks of block_size
tokens from one shared pool; each sequence has a block table (logical block i -> physical block),
blocks are taken on demand and returned when the sequence ends, so a sequence wastes less than one
block (block_size - 1 slots) where the contiguous cache wastes (max_len - length). Sequences that
start alike share the blocks of their common prefix (reference counts); writing into a shared
block first copies it (copy-on-write). Attention gathers the blocks through the table.
Memory: block_bytes = 2 · n_layer · H · block_size · D · itemsize (per rank; H = n_head / tp).
"""
import weakref

import numpy as np

from .. import backend, memory
from ..nn.generation import ContiguousKVCache, KVCache, release_entries

__all__ = ["BlockPool", "PagedKVCache", "ContiguousKVCache", "NoFreeBlocks", "append_slots"]


class NoFreeBlocks(MemoryError):
    """The pool (or the teaching device under it) has no block left."""


class BlockPool:
    """``num_blocks`` physical blocks, each holding K and V of ``block_size`` tokens in every layer
    (vLLM's block: one id, the same in every layer's store): arrays (n_layer, num_blocks, H,
    block_size, D). The pool stands for the device memory set aside for K/V; a block counts in the
    memory ledger (``kv_cache``) from ``allocate`` to its last ``release``, so the teaching device's
    capacity limits how many sequences hold blocks at once. Swapped-out blocks are host entries."""

    def __init__(self, num_blocks, block_size, n_layer, n_head, head_dim, dtype, xp=np):
        if block_size < 1:
            raise ValueError(f"block size must be a positive number of tokens, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size, self.xp = num_blocks, block_size, xp
        shape = (n_layer, num_blocks, n_head, block_size, head_dim)
        self.k, self.v = xp.zeros(shape, dtype), xp.zeros(shape, dtype)
        self.block_bytes = 2 * n_layer * n_head * block_size * head_dim * np.dtype(dtype).itemsize
        self.refcount = np.zeros(num_blocks, dtype=np.int64)
        self._free = list(range(num_blocks - 1, -1, -1))      # pop() hands out the lowest id first
        self.tracker = memory.tracker()
        self.copies = 0                                      # copy-on-write copies made
        self._keys = set()                                   # ledger entries held (released if collected)
        weakref.finalize(self, release_entries, self.tracker, self._keys)

    def num_free(self):
        """Blocks that can be allocated now: free in the pool and room on the teaching device."""
        room = self.tracker.free_bytes()
        return len(self._free) if room is None else min(len(self._free), max(room, 0) // self.block_bytes)

    def num_held(self):
        return self.num_blocks - len(self._free)

    def allocate(self):
        if not self._free:
            raise NoFreeBlocks(f"all {self.num_blocks} blocks of the KV pool are taken")
        b = self._free[-1]
        self.tracker.add("kv_cache", ("kv_block", id(self), b), self.block_bytes)   # the device may refuse
        self._keys.add(("kv_block", id(self), b))
        self._free.pop()
        self.refcount[b] = 1
        return b

    def share(self, b):
        self.refcount[b] += 1

    def release(self, b):
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.tracker.remove(("kv_block", id(self), b))
            self._keys.discard(("kv_block", id(self), b))
            self._free.append(b)

    def copy(self, src, dst):
        """Block dst := block src in every layer (on the device: copy-on-write)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.copies += 1

    def swap_out(self, blocks, key):
        """Host copies of ``blocks`` (one counted device -> host copy each of K and V), entered in the
        ledger as host memory under ``key``; the caller releases the device blocks."""
        k, v = backend.to_host(self.k[:, blocks]), backend.to_host(self.v[:, blocks])
        self.tracker.add("kv_cache", key, k.nbytes + v.nbytes, host=True)
        self._keys.add(key)
        return k, v

    def drop_host(self, key):
        """A swapped-out copy nobody will bring back (its sequence ended) leaves the ledger."""
        self.tracker.remove(key)
        self._keys.discard(key)

    def swap_in(self, host, blocks, key):
        """Copy host K/V back into the (newly allocated) device ``blocks``; the host copy leaves the ledger."""
        k, v = host
        device = "cpu" if self.xp is np else "cuda"
        self.k[:, blocks] = backend.to_device(k, device)
        self.v[:, blocks] = backend.to_device(v, device)
        self.drop_host(key)


def append_slots(table, start, num_new, block_size, pool):
    """vLLM's append_slots (Kwon et al. 2023, sec. 4.3, Figs. 6 and 8): make a sequence's block
    ``table`` (changed in place) hold its tokens start .. start + num_new - 1, and return where each
    goes, (physical block, offset) in order. A logical block past the table's end takes a fresh block
    from the pool when its first token comes, never ahead (a sequence wastes less than one block); a
    block shared with other sequences (refcount > 1) that a new token writes into is copied first,
    and the copy replaces it in this table (copy-on-write): the others keep reading theirs."""
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        elif pool.refcount[table[i]] > 1:
            fresh = pool.allocate()
            pool.copy(table[i], fresh)
            pool.release(table[i])
            table[i] = fresh
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]


class PagedKVCache(KVCache):
    """Block tables over a ``BlockPool``. ``add_sequence(id, prefix_of=src, prefix_len=c)`` starts a
    sequence on the first c tokens of ``src`` (their blocks shared). ``positions`` allocates the blocks
    the new tokens need and copies a shared block before writing into it. ``append`` writes each new
    token at (table[p // block_size], p % block_size) and gathers the batch's blocks into (B, H, L, D)
    with L = (most blocks in the batch) · block_size, the mask hiding slots past each sequence."""

    def __init__(self, pool, max_len, n_layer, n_head, head_dim):
        super().__init__(n_layer, n_head, head_dim, pool.k.dtype, pool.xp)
        self.pool, self.block_size, self.max_len = pool, pool.block_size, max_len
        self.tables = {}                   # sequence id -> [physical block of logical block 0, 1, ...]
        self.swapped = {}                  # sequence id -> host (k, v) of its blocks
        self.blocks_swapped_out = self.blocks_swapped_in = 0

    @classmethod
    def for_model(cls, model, block_size=16, num_blocks=None, max_len=None, num_sequences=0):
        """A paged cache for ``model`` (this rank's heads under tensor parallelism). ``num_blocks``
        default: enough for ``max(num_sequences, 1)`` sequences of ``max_len`` (the context) tokens.
        ``num_sequences`` empty sequences (ids 0, 1, ...) are added, ready for ``GPT.generate``."""
        attn, w = model.h[0].attn, model.wpe.weight.data
        max_len = max_len or model.config.block_size
        if block_size < 1:
            raise ValueError(f"block size must be a positive number of tokens, got {block_size}")
        if num_blocks is None:
            num_blocks = max(num_sequences, 1) * -(-max_len // block_size)
        pool = BlockPool(num_blocks, block_size, len(model.h), attn.n_head, attn.head_dim, w.dtype,
                         backend.array_module(w))
        cache = cls(pool, max_len, len(model.h), attn.n_head, attn.head_dim)
        for s in range(num_sequences):
            cache.add_sequence(s)
        return cache

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    # ---- sequences
    def add_sequence(self, seq_id, prefix_of=None, prefix_len=0):
        """A new sequence, empty or starting with the first ``prefix_len`` cached tokens of ``prefix_of``
        (the blocks holding them are shared, not copied)."""
        if seq_id in self.lengths or seq_id in self.swapped:
            raise KeyError(f"sequence {seq_id} is already in the cache")
        self.tables[seq_id], self.lengths[seq_id] = [], 0
        if prefix_of is not None and prefix_len > 0:
            self.share_prefix(seq_id, prefix_of, prefix_len)

    def share_prefix(self, seq_id, source, length):
        """The empty sequence ``seq_id`` starts with ``source``'s first ``length`` tokens: its table points
        at the blocks holding them (reference counts + 1), the last one maybe partly (copied on write)."""
        if self.lengths[seq_id] or self.tables[seq_id]:
            raise ValueError(f"sequence {seq_id} already holds tokens: only an empty sequence takes a prefix")
        if not 0 < length <= self.lengths[source]:
            raise ValueError(f"sequence {source} holds {self.lengths[source]} tokens, cannot share {length}")
        table = self.tables[source][:self.blocks_for(length)]
        for b in table:
            self.pool.share(b)
        self.tables[seq_id], self.lengths[seq_id] = list(table), length

    def free_sequence(self, seq_id):
        if seq_id in self.swapped:
            self.pool.drop_host(("kv_swap", id(self), seq_id))
            del self.swapped[seq_id]
        else:
            for b in self.tables.pop(seq_id):
                self.pool.release(b)
        del self.lengths[seq_id]
        self.batch = [s for s in self.batch if s != seq_id]

    def blocks_needed(self, seq_id, num_new):
        """Blocks that appending ``num_new`` tokens takes from the pool: new logical blocks, plus a copy
        of each shared block the new tokens would write into (copy-on-write)."""
        table, start = self.tables[seq_id], self.lengths[seq_id]
        first, last = start // self.block_size, (start + num_new - 1) // self.block_size
        return sum(1 for i in range(first, last + 1) if i >= len(table) or self.pool.refcount[table[i]] > 1)

    # ---- swapping whole sequences (vLLM's preemption by swapping)
    def swap_out(self, seq_id):
        """Move the sequence's blocks to host memory and free them on the device; returns how many."""
        table = self.tables.pop(seq_id)
        self.swapped[seq_id] = self.pool.swap_out(table, ("kv_swap", id(self), seq_id))
        for b in table:
            self.pool.release(b)
        self.blocks_swapped_out += len(table)
        self.batch = [s for s in self.batch if s != seq_id]
        return len(table)

    def swap_in(self, seq_id):
        """Bring a swapped sequence back into freshly allocated blocks (the same K/V, bit for bit)."""
        host = self.swapped[seq_id]
        table = [self.pool.allocate() for _ in range(host[0].shape[1])]
        self.pool.swap_in(host, table, ("kv_swap", id(self), seq_id))
        del self.swapped[seq_id]
        self.tables[seq_id] = table
        self.blocks_swapped_in += len(table)
        return len(table)

    # ---- the protocol
    def select(self, seq_ids):
        swapped = [s for s in seq_ids if s in self.swapped]
        if swapped:
            raise KeyError(f"sequences {swapped} are swapped out to the host: swap_in first")
        super().select(seq_ids)

    def _make_room(self, num_new):
        """Every sequence's slots for its new tokens (append_slots: blocks on demand, copy-on-write)."""
        for s in self.batch:
            if self.lengths[s] + num_new > self.max_len:
                raise ValueError(f"sequence {s} would reach {self.lengths[s] + num_new} tokens, past max_len "
                                 f"{self.max_len}")
        self._slots = [append_slots(self.tables[s], self.lengths[s], num_new, self.block_size, self.pool)
                       for s in self.batch]

    def _prepare(self, starts, num_new):
        bs = self.block_size
        tables = [self.tables[s] for s in self.batch]
        slots = np.array([slot for row in self._slots for slot in row], dtype=np.int64).reshape(-1, 2)
        self._write_blocks = self._on_device(slots[:, 0])
        self._write_offsets = self._on_device(slots[:, 1])
        width = max(len(t) for t in tables)
        padded = np.zeros((len(tables), width), dtype=np.int64)              # block 0 pads: masked out
        for b, t in enumerate(tables):
            padded[b, :len(t)] = t
        self._table = self._on_device(padded)
        self._mask_now = self._mask(starts, num_new, width * bs)

    def append(self, layer, k, v):
        """Write the new tokens into their blocks, then read every block of the batch's tables: the
        gather pool[table] is (B, blocks, H, block_size, D), laid out as (B, H, blocks·block_size, D)."""
        B, H, T, D = k.shape
        out = []
        for store, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):   # (num_blocks, H, bs, D)
            store[self._write_blocks, :, self._write_offsets] = new.transpose(0, 2, 1, 3).reshape(B * T, H, D)
            gathered = store[self._table]
            n = gathered.shape[1]
            out.append(gathered.transpose(0, 2, 1, 3, 4).reshape(B, H, n * self.block_size, D))
        return out[0], out[1], self._mask_now

    # ---- accounting
    def reserved_bytes(self):
        """Blocks held on the device (each once, however many sequences share it)."""
        return self.pool.num_held() * self.pool.block_bytes

    def used_bytes(self):
        """Slots holding K/V some sequence on the device attends to (a shared slot counted once)."""
        valid = {}
        for s, table in self.tables.items():
            length = self.lengths[s]
            for i, b in enumerate(table):
                valid[b] = max(valid.get(b, 0), min(self.block_size, length - i * self.block_size))
        return sum(valid.values()) * self.bytes_per_token

    def tokens_held(self):
        return sum(self.lengths[s] for s in self.tables)

    def describe(self):
        """The block tables as text: one line per sequence, shared blocks starred."""
        lines = []
        for s, table in self.tables.items():
            cells = " ".join(f"{b}{'*' if self.pool.refcount[b] > 1 else ''}" for b in table)
            lines.append(f"seq {s} ({self.lengths[s]} tokens): [{cells}]")
        lines += [f"seq {s}: swapped to host ({self.swapped[s][0].shape[1]} blocks)" for s in self.swapped]
        return "\n".join(lines)

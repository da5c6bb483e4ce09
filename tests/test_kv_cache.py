"""The KV caches as data structures: block tables, allocation on demand, reference counts, copy-on-write,
swapping, the gather attention reads, and the memory ledger (category kv_cache)."""
import numpy as np
import pytest

from minitrain import memory
from minitrain.inference import BlockPool, ContiguousKVCache, NoFreeBlocks, PagedKVCache

L, H, D = 2, 3, 4            # layers, heads, head size


def paged(num_blocks=16, block_size=4, max_len=64):
    pool = BlockPool(num_blocks, block_size, L, H, D, np.float64)
    return PagedKVCache(pool, max_len, L, H, D)


def contiguous(num_slots=4, max_len=16):
    return ContiguousKVCache(L, H, D, num_slots, max_len, np.float64)


def feed(cache, seqs, num_new, rng, layer_values=None):
    """One forward's worth of cache traffic for ``seqs``: positions, append in every layer, advance.
    Returns what layer 0 read (keys, values, mask) and the K/V written per layer."""
    cache.select(seqs)
    pos = cache.positions(num_new)
    written, read = [], None
    for layer in range(L):
        k = rng.standard_normal((len(seqs), H, num_new, D))
        v = rng.standard_normal((len(seqs), H, num_new, D))
        out = cache.append(layer, k, v)
        written.append((k, v))
        if layer == 0:
            read = out
    cache.advance(num_new)
    return pos, read, written


class Reference:
    """What each sequence's K/V must be: a plain list per sequence and layer."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, seqs, written):
        for layer, (k, v) in enumerate(written):
            for b, s in enumerate(seqs):
                self.k.setdefault((s, layer), []).extend(k[b].transpose(1, 0, 2))
                self.v.setdefault((s, layer), []).extend(v[b].transpose(1, 0, 2))

    def keys(self, s, layer=0):
        return np.array(self.k[(s, layer)]).transpose(1, 0, 2)       # (H, length, D)


@pytest.mark.parametrize("make", [paged, contiguous], ids=["paged", "contiguous"])
def test_attention_reads_every_sequences_own_keys_through_the_cache(make, rng):
    cache, ref = make(), Reference()
    for s in (0, 1, 2):
        cache.add_sequence(s)
    lengths = {0: 5, 1: 3, 2: 7}                                     # prefills of different lengths, one by one
    for s, n in lengths.items():
        pos, read, written = feed(cache, [s], n, rng)
        assert pos.tolist() == [list(range(n))]
        ref.add([s], written)
    for step in range(6):                                            # batched decoding, one token each
        pos, (keys, values, mask), written = feed(cache, [2, 0, 1], 1, rng)
        ref.add([2, 0, 1], written)
        assert pos[:, 0].tolist() == [lengths[2] + step, lengths[0] + step, lengths[1] + step]
        for b, s in enumerate([2, 0, 1]):
            n = lengths[s] + step + 1
            np.testing.assert_array_equal(keys[b][:, :n], ref.keys(s))           # the same bits, in order
            assert not mask[b, 0, 0, :n].any() and mask[b, 0, 0, n:].all()       # padding hidden
    assert cache.tokens_held() == sum(lengths.values()) + 3 * 6
    cache.release()


def test_a_prefill_is_causal_inside_the_new_tokens(rng):
    cache = paged(block_size=3)
    cache.add_sequence(0)
    feed(cache, [0], 2, rng)
    _, (_, _, mask), _ = feed(cache, [0], 4, rng)                   # positions 2..5 after 2 cached
    expected = np.arange(6)[None, :] > (2 + np.arange(4))[:, None]
    np.testing.assert_array_equal(mask[0, 0, :, :6], expected)
    cache.release()


@pytest.mark.parametrize("make", [paged, contiguous], ids=["paged", "contiguous"])
def test_a_cache_dropped_without_release_leaves_the_ledger(make, rng):
    tracker = memory.tracker()
    before, host_before = tracker.live["kv_cache"], tracker.host_live["kv_cache"]
    cache = make()
    cache.add_sequence(0)
    cache.add_sequence(1)
    feed(cache, [0, 1], 3, rng)
    if isinstance(cache, PagedKVCache):
        cache.swap_out(1)
        assert tracker.host_live["kv_cache"] > host_before
    assert tracker.live["kv_cache"] > before
    del cache
    assert (tracker.live["kv_cache"], tracker.host_live["kv_cache"]) == (before, host_before)


def test_blocks_are_taken_on_demand_and_returned_when_a_sequence_ends(rng):
    tracker = memory.tracker()
    before = tracker.live["kv_cache"]
    cache = paged(num_blocks=8, block_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    feed(cache, [0], 5, rng)                                        # 5 tokens: 2 blocks
    assert len(cache.tables[0]) == 2 and cache.tables[1] == []
    for n in range(3):
        feed(cache, [0], 1, rng)                                    # 6, 7, 8 tokens: still 2 blocks
    assert len(cache.tables[0]) == 2
    feed(cache, [0], 1, rng)                                        # the 9th token takes a third block
    assert len(cache.tables[0]) == 3
    feed(cache, [1], 1, rng)
    held = 4 * cache.pool.block_bytes
    assert cache.reserved_bytes() == held == tracker.live["kv_cache"] - before
    assert cache.used_bytes() == (9 + 1) * cache.bytes_per_token == 10 * 2 * L * H * D * 8
    cache.free_sequence(0)
    assert cache.pool.num_free() == 8 - 1 and tracker.live["kv_cache"] - before == cache.pool.block_bytes
    cache.release()
    assert tracker.live["kv_cache"] == before


def test_paged_waste_is_under_one_block_per_sequence_and_contiguous_wastes_the_rest_of_max_len(rng):
    lengths = [1, 4, 5, 11, 16]
    for block_size in (1, 3, 4, 16):
        cache = paged(num_blocks=64, block_size=block_size)
        for s, n in enumerate(lengths):
            cache.add_sequence(s)
            feed(cache, [s], n, rng)
        waste = cache.reserved_bytes() - cache.used_bytes()
        slots = sum(-(-n // block_size) * block_size - n for n in lengths)       # the last block's empty slots
        assert waste == slots * cache.bytes_per_token < len(lengths) * block_size * cache.bytes_per_token
        cache.release()
    cache = contiguous(num_slots=5, max_len=16)
    for s, n in enumerate(lengths):
        cache.add_sequence(s)
        feed(cache, [s], n, rng)
    assert cache.reserved_bytes() - cache.used_bytes() == sum(16 - n for n in lengths) * cache.bytes_per_token
    cache.release()


def test_shared_prefix_blocks_are_counted_once_and_copied_on_write(rng):
    cache, ref = paged(num_blocks=16, block_size=4), Reference()
    cache.add_sequence(0)
    _, _, written = feed(cache, [0], 6, rng)                        # blocks [a (4 tokens), b (2 tokens)]
    ref.add([0], written)
    a, b = cache.tables[0]
    cache.add_sequence(1, prefix_of=0, prefix_len=5)                # shares a fully, b for its first token
    assert cache.tables[1] == [a, b] and cache.pool.refcount[[a, b]].tolist() == [2, 2]
    assert cache.reserved_bytes() == 2 * cache.pool.block_bytes and cache.used_bytes() == 6 * cache.bytes_per_token
    original = cache.pool.k[:, b].copy()
    # what the scheduler must keep free: a copy of b to write into it, and a new block past it
    assert (cache.blocks_needed(1, 2), cache.blocks_needed(1, 4), cache.blocks_needed(0, 1)) == (1, 2, 1)
    _, (keys, _, _), written = feed(cache, [1], 2, rng)             # writes slots 1, 2 of b: copy first
    assert cache.tables[1][0] == a and cache.tables[1][1] != b and cache.pool.copies == 1
    assert cache.pool.refcount[[a, b]].tolist() == [2, 1]
    np.testing.assert_array_equal(cache.pool.k[:, b], original)     # the source's block is untouched
    np.testing.assert_array_equal(keys[0][:, :5], ref.keys(0)[:, :5])   # the shared tokens are seq 0's
    np.testing.assert_array_equal(keys[0][:, 5:7], written[0][0][0])    # then its own
    _, (keys0, _, _), _ = feed(cache, [0], 1, rng)                  # seq 0 writes into b: b is its own again
    assert cache.pool.copies == 1 and cache.tables[0] == [a, b]
    np.testing.assert_array_equal(keys0[0][:, :6], ref.keys(0))
    cache.release()
    assert cache.pool.num_free() == 16


def test_swapping_a_sequence_out_and_back_keeps_its_kv_bit_for_bit(rng):
    tracker = memory.tracker()
    before, host_before = tracker.live["kv_cache"], tracker.host_live["kv_cache"]
    cache = paged(num_blocks=6, block_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    feed(cache, [0], 7, rng)
    feed(cache, [1], 9, rng)
    _, (keys, values, _), _ = feed(cache, [0], 1, rng)
    assert cache.swap_out(0) == 2 and cache.blocks_swapped_out == 2
    assert tracker.host_live["kv_cache"] - host_before == 2 * cache.pool.block_bytes
    assert tracker.live["kv_cache"] - before == 3 * cache.pool.block_bytes
    with pytest.raises(KeyError, match="swapped out"):
        cache.select([0])
    cache.add_sequence(2)
    feed(cache, [2], 8, rng)                                        # takes the freed blocks
    cache.free_sequence(2)
    cache.swap_in(0)                                                # into other physical blocks
    assert tracker.host_live["kv_cache"] == host_before and cache.blocks_swapped_in == 2
    cache.lengths[0] -= 1                                           # read the same 8 tokens again
    _, (keys2, values2, _), _ = feed(cache, [0], 1, rng)
    np.testing.assert_array_equal(keys2[0][:, :7], keys[0][:, :7])
    np.testing.assert_array_equal(values2[0][:, :7], values[0][:, :7])
    cache.release()
    assert tracker.live["kv_cache"] == before


def test_the_teaching_device_limits_the_blocks(rng):
    tracker = memory.tracker()
    cache = paged(num_blocks=10, block_size=2)
    old = tracker.capacity
    memory.set_device_capacity(tracker.live_total + 3 * cache.pool.block_bytes)
    try:
        assert cache.pool.num_free() == 3
        cache.add_sequence(0)
        feed(cache, [0], 6, rng)
        assert cache.pool.num_free() == 0
        with pytest.raises(memory.DeviceOutOfMemory):
            feed(cache, [0], 1, rng)
    finally:
        memory.set_device_capacity(old)
        cache.release()
    full = paged(num_blocks=1, block_size=2)
    full.add_sequence(0)
    with pytest.raises(NoFreeBlocks):
        feed(full, [0], 3, rng)
    full.release()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block size must be a positive number of tokens, got 0"):
        BlockPool(4, 0, L, H, D, np.float64)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, 4, L, H, D, np.float64)
    cache = contiguous(num_slots=1, max_len=4)
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="past the cache's max_len 4"):
        feed(cache, [0], 5, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="slots"):
        cache.add_sequence(1)
    cache.release()

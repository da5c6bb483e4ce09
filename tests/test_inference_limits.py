"""The engine at the edges of what fits: a device or a pool that holds exactly the longest sequence's
K/V serves it (exactly); one block less is refused in one line naming the limit (the device or
num_blocks), never a scheduler that cannot run; the cache is sized for the sequences that can run at
once, not for max_batch; counts and ids that are not integers are refused, not rounded; a
sequence-parallel model or a mixture of experts with a capacity is refused before it serves anything,
and GPT.generate refuses shapes it cannot take."""
import dataclasses
import re

import numpy as np
import pytest

import minitrain
from minitrain import memory, nn
from minitrain.comm import ThreadWorld
from minitrain.inference import DoesNotFit, LLMEngine, PagedKVCache, engine
from minitrain.parallel.tensor_parallel import tensor_parallelize
from test_inference import CONFIG, assert_exact, bytes_per_token

PROMPTS = [[1] * 17, [2, 5, 7, 3, 9]]
NEW = 10                   # the longest sequence holds 17 + 10 - 1 = 26 tokens' K/V: its last token is never fed


@pytest.fixture
def gpt(float64):
    minitrain.manual_seed(5)
    return nn.GPT(CONFIG)


def with_capacity(kv_tokens, run):
    tracker = memory.tracker()
    old = tracker.capacity
    memory.set_device_capacity(tracker.live_total + kv_tokens * bytes_per_token())
    try:
        return run()
    finally:
        memory.set_device_capacity(old)


@pytest.mark.parametrize("block_size", [1, 2, 13])
def test_a_device_holding_exactly_the_longest_sequences_kv_serves_it_exactly(gpt, block_size):
    blocks = -(-26 // block_size)
    for preempt in ("swap", "recompute"):
        result = with_capacity(blocks * block_size, lambda: LLMEngine(
            gpt, cache="paged", block_size=block_size, preempt=preempt).generate(PROMPTS, NEW, record_logits=True))
        assert_exact(result, gpt, PROMPTS)
    pooled = LLMEngine(gpt, cache="paged", block_size=block_size, num_blocks=blocks).generate(
        PROMPTS, NEW, record_logits=True)
    assert_exact(pooled, gpt, PROMPTS)
    with pytest.raises(DoesNotFit, match=rf"sequences of up to {(blocks - 1) * block_size} tokens fit; the longest "
                                         rf"sequence here holds 26 tokens' K/V .*Give a device memory of at least"):
        with_capacity((blocks - 1) * block_size, lambda: LLMEngine(
            gpt, cache="paged", block_size=block_size).generate(PROMPTS, NEW))


def test_num_blocks_is_checked_and_the_device_caps_it(gpt):
    # more blocks asked than the device holds: the device is the limit, and says so before serving
    with pytest.raises(DoesNotFit, match=r"the device .* 2 blocks of 4 tokens .*Give a device memory of at least"):
        with_capacity(8, lambda: LLMEngine(gpt, cache="paged", block_size=4, num_blocks=100).generate(PROMPTS, NEW))
    with pytest.raises(DoesNotFit, match=r"the pool has num_blocks=6: .*holds 26 tokens' K/V.* Give num_blocks >= 7"):
        LLMEngine(gpt, cache="paged", block_size=4, num_blocks=6).generate(PROMPTS, NEW)
    for num_blocks, cache in ((0, "paged"), (-1, "paged"), (2.5, "paged"), (4, "contiguous")):
        with pytest.raises(ValueError, match=rf"num_blocks sizes the paged cache's pool: .*got {num_blocks} with "
                                             rf"cache='{cache}'"):
            LLMEngine(gpt, cache=cache, num_blocks=num_blocks)


def test_the_cache_is_sized_for_the_sequences_that_can_run_not_for_max_batch(gpt, monkeypatch):
    huge = 10 ** 9                                  # a batch limit far above the prompts: no pool for it
    for cache in ("paged", "contiguous"):
        result = LLMEngine(gpt, cache=cache, block_size=4, max_batch=huge).generate(PROMPTS, NEW)
        assert result.tokens == LLMEngine(gpt, cache="none").generate(PROMPTS, NEW).tokens
    assert result.kv_bytes_reserved == 2 * CONFIG.block_size * bytes_per_token()       # the contiguous one
    assert LLMEngine(gpt, block_size=4, max_batch=huge).generate(PROMPTS, NEW).num_blocks == 2 * 10

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 61.0 GiB")
    monkeypatch.setattr(engine, "BlockPool", out_of_memory)
    with pytest.raises(DoesNotFit, match=r"the KV cache \(20 blocks = .* bytes\) cannot be allocated on this "
                                         r"machine \(Unable to allocate 61.0 GiB\): give fewer sequences"):
        LLMEngine(gpt, block_size=4).generate(PROMPTS, NEW)


def test_counts_and_token_ids_must_be_integers(gpt):
    e = LLMEngine(gpt, cache="paged", block_size=4)
    for bad in (2.5, True, 0):
        with pytest.raises(ValueError, match=f"max new tokens must be an integer >= 1, got {bad}"):
            e.generate(PROMPTS, bad)
    assert len(e.generate(PROMPTS, np.int64(3)).tokens[0]) == 3
    with pytest.raises(ValueError, match="top_k an integer >= 1, got 1.0, 2.5"):
        e.generate(PROMPTS, 2, temperature=1.0, top_k=2.5)
    for bad in (-1, None, 1.5):
        with pytest.raises(ValueError, match=f"seed must be an integer >= 0, got {bad}"):
            e.generate(PROMPTS, 2, temperature=1.0, seed=bad)
    with pytest.raises(ValueError, match="prompt 0 holds True, not a token id"):
        e.generate([[True, 2]], 2)
    with pytest.raises(ValueError, match="prompt 0 is 1, not a list of token ids: give a list of prompts"):
        e.generate([1, 2, 3], 2)                    # one prompt, not wrapped in a list
    assert e.generate(iter(PROMPTS), 2).tokens == e.generate(PROMPTS, 2).tokens      # any iterable of prompts
    for option in ("block_size", "max_batch"):
        with pytest.raises(ValueError, match=", got 2.5"):
            LLMEngine(gpt, **{option: 2.5})


def _engine_on_sequence_parallel(comm, state):
    minitrain.set_default_dtype(np.float64)
    gpt = nn.GPT(CONFIG)
    gpt.load_state_dict(state)
    with pytest.raises(ValueError, match=rf"\[rank {comm.rank}\] LLMEngine serves a tensor-parallel model without "
                                         r"sequence parallelism"):
        LLMEngine(tensor_parallelize(gpt, comm, sequence_parallel=True), cache="none")
    return LLMEngine(tensor_parallelize(gpt, comm), cache="none").generate([[1, 2, 3]], 2).tokens


def test_a_sequence_parallel_model_is_refused_before_serving(gpt):
    # else it would fail mid-serving, and with cache "none" only on a batch of odd length
    state = {name: q.data.copy() for name, q in gpt.named_parameters()}
    expect = LLMEngine(gpt, cache="none").generate([[1, 2, 3]], 2).tokens
    assert ThreadWorld(2).run(_engine_on_sequence_parallel, state) == [expect, expect]


def test_gpt_generate_refuses_shapes_and_counts_it_cannot_serve(gpt):
    for idx, new in ((np.zeros((1, 0), np.int64), 3), (np.zeros((0, 3), np.int64), 3), (np.array([1, 2]), 3),
                     (np.array([[1, 2]]), -1), (np.array([[1, 2]]), 2.0)):
        for cache in ("contiguous", None):
            shape = re.escape(str(idx.shape))
            with pytest.raises(ValueError, match=rf"generate takes idx of shape \(B, T\), B and T >= 1, and "
                                                 rf"max_new_tokens an integer >= 0; got shape {shape}"):
                gpt.generate(idx, new, cache=cache)
    assert gpt.generate(np.array([[1, 2]]), 0).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="a block pool needs at least one block, got 0"):
        PagedKVCache.for_model(gpt, num_blocks=0)


def test_a_mixture_of_experts_is_served_dropless_or_refused(float64):
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8], [9, 7]]
    for extra, why in ((dict(moe_capacity_factor=1.0), "capacity factor 1.0: which experts take a token would "
                                                       "depend on the rest of its batch"),
                       (dict(moe_groups=2), "2 capacity groups: a decode step's one token per sequence")):
        config = dataclasses.replace(CONFIG, moe_experts=4, moe_top_k=2, **extra)
        with pytest.raises(ValueError, match=rf"LLMEngine serves mixtures of experts dropless, and h.0.mlp has {why}"):
            LLMEngine(nn.GPT(config))
    dropless = nn.GPT(dataclasses.replace(CONFIG, moe_experts=4, moe_top_k=2))
    for cache in ("none", "contiguous", "paged"):
        result = LLMEngine(dropless, cache=cache, block_size=3, max_batch=2).generate(prompts, 6, record_logits=True)
        assert_exact(result, dropless, prompts)

"""Generation is exact: greedy tokens identical and logits equal in float64 within 1e-10 across no
cache, the contiguous cache, the paged cache (block sizes 1, 3 = dividing no prompt length, 4, 64),
shared prefixes, swapped and recomputed preemption, and tensor parallelism; sampling with a seed gives
the same tokens under every scheme; memory figures equal the ledger and the formulas."""
import numpy as np
import pytest

import minitrain
from minitrain import memory, nn
from minitrain.comm import ThreadWorld
from minitrain.inference import DoesNotFit, LLMEngine, PagedKVCache, Scheduler, sample
from minitrain.parallel.tensor_parallel import tensor_parallelize

CONFIG = nn.GPTConfig(vocab_size=13, block_size=40, n_layer=2, n_head=4, n_embd=16)
LENGTHS = (5, 11, 1, 8, 17, 2)                  # mixed: block size 3 divides none of them
NEW = 10


@pytest.fixture
def gpt(float64):
    minitrain.manual_seed(3)
    return nn.GPT(CONFIG)


def make_prompts(shared=0, seed=0):
    rng = np.random.default_rng(seed)
    prefix = list(rng.integers(0, CONFIG.vocab_size, shared))
    return [prefix + list(rng.integers(0, CONFIG.vocab_size, n)) for n in LENGTHS]


def reference_logits(model, prompts, tokens):
    """The truth: one plain forward per sequence over its prompt + generated tokens (no cache, no batch)."""
    out = []
    for p, t in zip(prompts, tokens):
        full = np.array([p + t[:-1]])
        out.append(model(full).data[0, len(p) - 1:])
    return out


def assert_exact(result, model, prompts):
    ref = reference_logits(model, prompts, result.tokens)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(result.logits, ref))
    assert worst < 1e-10, worst
    greedy = [list(np.argmax(r, axis=1)) for r in ref]
    assert result.tokens == greedy                                   # greedy: each token the argmax of the truth


def bytes_per_token(tp=1):
    return 2 * CONFIG.n_layer * CONFIG.n_embd // tp * 8


SCHEMES = {
    "contiguous": dict(cache="contiguous"),
    "paged-1": dict(cache="paged", block_size=1),
    "paged-3": dict(cache="paged", block_size=3),
    "paged-4-batch-2": dict(cache="paged", block_size=4, max_batch=2),
    "paged-64": dict(cache="paged", block_size=64),
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_cache_gives_the_logits_of_no_cache(gpt, name):
    prompts = make_prompts()
    none = LLMEngine(gpt, cache="none").generate(prompts, NEW, record_logits=True)
    assert_exact(none, gpt, prompts)
    result = LLMEngine(gpt, **SCHEMES[name]).generate(prompts, NEW, record_logits=True)
    assert_exact(result, gpt, prompts)
    assert result.tokens == none.tokens
    assert result.kv_ledger_bytes == result.kv_bytes_reserved > 0
    assert memory.snapshot()["kv_cache"] == 0                       # everything returned at the end


def test_shared_prefixes_share_blocks_copy_on_write_and_stay_exact(gpt):
    prompts = make_prompts(shared=7)
    plain = LLMEngine(gpt, cache="paged", block_size=3).generate(prompts, NEW, record_logits=True)
    shared = LLMEngine(gpt, cache="paged", block_size=3, share_prefix=True).generate(prompts, NEW,
                                                                                     record_logits=True)
    assert_exact(shared, gpt, prompts)
    assert shared.tokens == plain.tokens
    assert shared.shared_tokens >= 7 * (len(prompts) - 1) and shared.cow_copies > 0
    assert shared.kv_bytes_reserved < plain.kv_bytes_reserved      # the prefix's blocks held once


@pytest.mark.parametrize("preempt", ["swap", "recompute"])
@pytest.mark.parametrize("share", [False, True], ids=["", "shared-prefix"])
def test_preemption_under_memory_pressure_is_exact(gpt, preempt, share):
    prompts = make_prompts(shared=6 if share else 0)
    block_size = 4
    tracker = memory.tracker()
    old = tracker.capacity
    longest = max(len(p) for p in prompts) + NEW
    memory.set_device_capacity(tracker.live_total + (-(-longest // block_size) + 2) * block_size * bytes_per_token())
    try:
        result = LLMEngine(gpt, cache="paged", block_size=block_size, preempt=preempt,
                           share_prefix=share).generate(prompts, NEW, record_logits=True)
    finally:
        memory.set_device_capacity(old)
    assert_exact(result, gpt, prompts)
    assert result.preemptions > 0
    if preempt == "swap":
        assert result.blocks_swapped == result.blocks_swapped_in > 0 and result.recomputed_tokens == 0
    else:
        assert result.blocks_swapped == 0 and result.recomputed_tokens > 0
    assert memory.snapshot()["kv_cache"] == 0 and memory.host_snapshot()["kv_cache"] == 0


def test_sampling_is_reproducible_and_the_same_under_every_scheme(gpt):
    prompts = make_prompts()
    kwargs = dict(temperature=0.9, top_k=5, seed=11)
    runs = [LLMEngine(gpt, cache="none").generate(prompts, NEW, **kwargs).tokens]
    for scheme in SCHEMES.values():
        runs.append(LLMEngine(gpt, **scheme).generate(prompts, NEW, **kwargs).tokens)
    assert all(r == runs[0] for r in runs)
    other = LLMEngine(gpt, cache="paged").generate(prompts, NEW, temperature=0.9, top_k=5, seed=12).tokens
    greedy = LLMEngine(gpt, cache="paged").generate(prompts, NEW).tokens
    assert other != runs[0] and greedy != runs[0]
    assert all(t < CONFIG.vocab_size for seq in runs[0] for t in seq)


def test_gpt_generate_with_each_cache_equals_no_cache_even_past_the_context(gpt):
    idx = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (3, 6))
    for temperature, top_k in ((0.0, None), (1.0, 4)):
        steps = CONFIG.block_size + 5                               # slides past the context at the end
        expect = gpt.generate(idx, steps, temperature, top_k, rng=np.random.default_rng(1), cache=None)
        got = gpt.generate(idx, steps, temperature, top_k, rng=np.random.default_rng(1))
        paged = gpt.generate(idx, steps, temperature, top_k, rng=np.random.default_rng(1),
                             cache=PagedKVCache.for_model(gpt, block_size=5, num_sequences=3))
        np.testing.assert_array_equal(got, expect)
        np.testing.assert_array_equal(paged, expect)
    assert memory.snapshot()["kv_cache"] == 0


def test_the_memory_figures_follow_the_formulas(gpt):
    prompts = make_prompts()
    lengths = [len(p) for p in prompts]
    contiguous = LLMEngine(gpt, cache="contiguous").generate(prompts, NEW)
    assert contiguous.kv_bytes_per_token == bytes_per_token()
    # every sequence admitted at once: the reservation is at its peak from the first step to the last,
    # when each sequence holds prompt + NEW - 1 tokens (the last one is sampled, never fed)
    assert contiguous.num_sequences == len(prompts)
    assert contiguous.kv_bytes_reserved == len(prompts) * CONFIG.block_size * bytes_per_token()
    assert contiguous.kv_bytes_used == sum(n + NEW - 1 for n in lengths) * bytes_per_token()
    for block_size in (1, 3, 4, 8):
        r = LLMEngine(gpt, cache="paged", block_size=block_size).generate(prompts, NEW)
        # the reservation only grows while they run: its last step at the peak is the last step
        used = sum(n + NEW - 1 for n in lengths)
        blocks = sum(-(-(n + NEW - 1) // block_size) for n in lengths)
        assert (r.kv_bytes_used, r.kv_bytes_reserved) == (used * bytes_per_token(),
                                                          blocks * block_size * bytes_per_token())
        assert r.kv_bytes_reserved - r.kv_bytes_used < r.num_sequences * block_size * bytes_per_token()
        assert r.kv_ledger_bytes == r.kv_bytes_reserved


def _generate_tp(comm, state, prompts, schemes, capacity_blocks):
    minitrain.set_default_dtype(np.float64)
    gpt = nn.GPT(CONFIG)
    gpt.load_state_dict(state)
    model = tensor_parallelize(gpt, comm)
    del gpt
    results = []
    for scheme in schemes:
        if scheme.get("preempt"):
            memory.set_device_capacity(memory.tracker().live_total + capacity_blocks * 4 * bytes_per_token(comm.size))
        try:
            results.append(LLMEngine(model, **scheme).generate(prompts, NEW, record_logits=True))
        finally:
            memory.set_device_capacity(None)
    return results


def test_tensor_parallel_generation_equals_one_process(gpt):
    prompts = make_prompts(shared=5)
    state = {name: q.data.copy() for name, q in gpt.named_parameters()}
    schemes = [dict(cache="contiguous"), dict(cache="paged", block_size=3, share_prefix=True),
               dict(cache="paged", block_size=4, preempt="swap"), dict(cache="paged", block_size=4, preempt="recompute")]
    for rank_results in ThreadWorld(2).run(_generate_tp, state, prompts, schemes, capacity_blocks=9):
        for scheme, r in zip(schemes, rank_results):
            assert_exact(r, gpt, prompts)
            assert r.kv_bytes_per_token == bytes_per_token(2)       # each rank its half of the heads
            if scheme.get("preempt"):
                assert r.preemptions > 0


def test_bad_inputs_are_refused_saying_what_fits(gpt):
    engine = LLMEngine(gpt, cache="paged", block_size=4)
    with pytest.raises(ValueError, match="41 tokens, longer than the model's context of 40 tokens: prompts of up "
                                         "to 30 tokens fit with 10 new tokens"):
        engine.generate([[1] * 41], 10)
    with pytest.raises(ValueError, match="at most 5 new tokens fit after it"):
        engine.generate([[1] * 35], 10)
    with pytest.raises(ValueError, match="block size must be a positive number of tokens, got 0"):
        LLMEngine(gpt, cache="paged", block_size=0)
    with pytest.raises(ValueError, match="block size must be a positive number of tokens, got -2"):
        PagedKVCache.for_model(gpt, block_size=-2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], 3)
    for bad in (-1, 13, 2.5):         # as torch.nn.Embedding: no id read as another row (-1: the last)
        with pytest.raises(ValueError, match=rf"prompt 1 holds {bad}, not a token id: ids are integers in \[0, 13\)"):
            engine.generate([[1], [2, bad]], 3)
    assert engine.generate(np.array([[1, 12]]), 2).tokens == engine.generate([[1, 12]], 2).tokens
    with pytest.raises(ValueError, match="no prompts: give at least one"):
        engine.generate([], 3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate([[1]], 3, temperature=float("nan"))
    tracker = memory.tracker()
    old = tracker.capacity
    memory.set_device_capacity(tracker.live_total + 5 * 4 * bytes_per_token())   # 5 blocks: 20 tokens
    try:
        with pytest.raises(DoesNotFit, match=r"5 blocks of 4 tokens .*sequences of up to 20 tokens fit; the "
                                             r"longest sequence here holds 26 tokens' K/V"):
            engine.generate([[1] * 17, [2] * 3], 10)
        with pytest.raises(DoesNotFit, match=r"reserves the context, 40 tokens = .* per sequence; 20 tokens fit"):
            LLMEngine(gpt, cache="contiguous").generate([[1] * 3], 10)
        assert len(engine.generate([[1] * 10, [2] * 3], 10).tokens) == 2           # 20 tokens: fits
    finally:
        memory.set_device_capacity(old)


def test_sample_is_greedy_at_temperature_0_and_keeps_to_the_top_k():
    logits = np.array([0.5, 3.0, -1.0, 2.9, 2.8, 0.0])
    rng = np.random.default_rng(0)
    assert sample(logits, 0.0) == 1
    assert {sample(logits, 1.0, top_k=1, rng=rng) for _ in range(50)} == {1}
    assert {sample(logits, 5.0, top_k=3, rng=rng) for _ in range(300)} == {1, 3, 4}
    assert len({sample(logits, 5.0, rng=rng) for _ in range(300)}) == 6
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample(logits, -1.0)
    for tiny in (1e-200, 1e-310, 5e-324):          # logits / temperature overflow: still the argmax, no NaN
        assert sample(logits, tiny, rng=rng) == 1 and sample(logits, tiny, top_k=2, rng=rng) == 1


def test_every_step_the_scheduler_promises_only_blocks_the_pool_has(gpt, monkeypatch):
    """The invariant behind 'never out of blocks mid-forward': after schedule(), the blocks this step's
    forwards will take (new blocks and copies on write) fit in what is free. Checked at every step of
    runs under pressure at several block sizes and capacities (block boundaries, swap-ins, sharing)."""
    original = Scheduler.schedule
    checked = []

    def checked_schedule(self):
        prefills, decodes = original(self)
        if self.paged:
            need = sum(self.cache.blocks_needed(s.id, 1) for s in decodes)
            need += sum(self.cache.blocks_for(len(s.tokens)) - len(self.cache.tables[s.id]) for s in prefills)
            assert need <= self.cache.pool.num_free(), (need, self.cache.pool.num_free())
            checked.append(need)
        return prefills, decodes

    monkeypatch.setattr(Scheduler, "schedule", checked_schedule)
    prompts = make_prompts(shared=4)
    tracker = memory.tracker()
    old = tracker.capacity
    for block_size in (2, 3, 5):
        longest = -(-(max(len(p) for p in prompts) + NEW) // block_size)
        for extra in range(4):
            for preempt, share in (("swap", False), ("swap", True), ("recompute", True)):
                memory.set_device_capacity(tracker.live_total + (longest + extra) * block_size * bytes_per_token())
                try:
                    LLMEngine(gpt, cache="paged", block_size=block_size, preempt=preempt,
                              share_prefix=share).generate(prompts, NEW)
                finally:
                    memory.set_device_capacity(old)
    assert len(checked) > 100


def test_the_contiguous_cache_admits_what_the_device_holds(gpt):
    prompts = make_prompts()
    tracker = memory.tracker()
    old = tracker.capacity
    memory.set_device_capacity(tracker.live_total + 2 * CONFIG.block_size * bytes_per_token())   # two sequences
    try:
        result = LLMEngine(gpt, cache="contiguous").generate(prompts, NEW, record_logits=True)
    finally:
        memory.set_device_capacity(old)
    assert_exact(result, gpt, prompts)
    assert result.num_sequences == 2 and result.kv_bytes_reserved == 2 * CONFIG.block_size * bytes_per_token()
    assert result.preemptions == 0

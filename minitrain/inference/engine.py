"""The serving loop: prompts in, tokens out, with no cache, a contiguous one or a paged one
(vLLM's LLMEngine in miniature): the scheduler picks each step's sequences, every running sequence
decodes one token in one batched forward, then new prompts are prefilled one at a time.

Cost per decoded token: no cache recomputes the whole prefix (a forward over L tokens, O(L²)
attention); with a cache one token's forward plus attention over L cached keys. Memory (per rank):
kv_bytes_per_token = 2 · n_layer · (n_embd / tp) · itemsize; contiguous reserves the context per
running sequence, paged ceil(length / block_size) blocks. The accounting (GenerationResult) is
taken after every step's forwards, and kept from the last step at the peak reservation (a sequence
of n tokens then holds n - 1 tokens' K/V: its last token is sampled, never fed); the ledger
(memory.py, kv_cache) counts the same bytes.
"""
import time
from dataclasses import dataclass

import numpy as np

from .. import backend, memory
from ..autograd import no_grad
from ..backend import is_int
from ..nn.generation import ContiguousKVCache, sample
from ..nn.moe import MoE
from .kv_cache import BlockPool, PagedKVCache
from .scheduler import Scheduler, Sequence

CACHES = ("none", "contiguous", "paged")


class DoesNotFit(ValueError):
    """The device cannot hold even one sequence's K/V (the message says what fits)."""


def check_dropless(model):
    """Mixtures of experts are served dropless (Mixtral's and vLLM's way): with a capacity, which experts
    take a token depends on the other tokens of its forward, so the cache, the batch and preemption would
    change the tokens; capacity groups cannot split a decode step's one token per sequence."""
    for name, layer in model.named_modules():
        if isinstance(layer, MoE) and (layer.capacity_factor is not None or layer.groups != 1):
            why = (f"capacity factor {layer.capacity_factor}: which experts take a token would depend on the rest of "
                   f"its batch" if layer.capacity_factor is not None else f"{layer.groups} capacity groups: a decode "
                   f"step's one token per sequence does not split into them")
            raise ValueError(f"LLMEngine serves mixtures of experts dropless, and {name} has {why}; serve "
                             f"nn.GPT(dataclasses.replace(config, moe_capacity_factor=None, moe_groups=1)) with these "
                             f"weights")


@dataclass
class GenerationResult:
    tokens: list                      # generated token ids, one list per prompt, in prompt order
    logits: list                      # per prompt: (new tokens, vocab) float64 host logits, if recorded
    elapsed: float                    # seconds, serving only
    tokens_per_second: float          # generated tokens (all prompts) / elapsed
    kv_bytes_per_token: int           # 2 · n_layer · n_head_local · head_dim · itemsize
    kv_bytes_reserved: int            # the largest reservation after any step
    kv_bytes_used: int                # bytes holding K/V after the last step with that reservation
    num_sequences: int                # sequences holding device memory (running) at that step
    kv_ledger_bytes: int              # the memory ledger's kv_cache bytes at that step (== reserved)
    blocks_swapped: int = 0           # blocks copied device -> host by preemption (and back: blocks_swapped_in)
    blocks_swapped_in: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0        # cached tokens dropped by recompute preemption and computed again
    shared_tokens: int = 0            # prompt tokens taken from another sequence's blocks (prefix sharing)
    cow_copies: int = 0               # blocks copied on write
    steps: int = 0                    # scheduler steps (each: prefills, then one batched decode)
    num_blocks: int = 0               # the pool's blocks (paged)
    block_bytes: int = 0


class LLMEngine:
    """``LLMEngine(model, cache="paged", block_size=16, max_batch=8, preempt="swap")`` then
    ``generate(prompts, max_new_tokens, temperature=0.0, top_k=None, seed=0)``. ``model`` is a GPT or
    its tensor-parallel form (each rank runs the same engine on its heads). Sequence i samples from
    its own generator, seeded (seed, i), so tokens do not depend on the cache, the batch or preemption.
    The device memory is the memory ledger's capacity (``memory.set_device_capacity``), if set. ``num_blocks``
    (paged): the pool's size; by default every sequence that can run at once (the prompts, at most max_batch)
    at the full context; the device caps either."""

    def __init__(self, model, cache="paged", block_size=16, max_batch=8, preempt="swap", share_prefix=False,
                 num_blocks=None):
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
        if not (is_int(block_size) and block_size >= 1):
            raise ValueError(f"block size must be a positive number of tokens, got {block_size}")
        if not (is_int(max_batch) and max_batch >= 1):
            raise ValueError(f"max batch must be >= 1 sequence, got {max_batch}")
        if preempt not in ("swap", "recompute"):
            raise ValueError(f"preempt must be 'swap' or 'recompute', got {preempt!r}")
        if num_blocks is not None and not (is_int(num_blocks) and num_blocks >= 1 and cache == "paged"):
            raise ValueError(f"num_blocks sizes the paged cache's pool: a number of blocks >= 1 with cache='paged', "
                             f"got {num_blocks!r} with cache={cache!r}")
        if getattr(model, "sequence_parallel", False):   # any cache: decoding feeds one token per sequence
            raise ValueError(f"[rank {model.comm.rank}] LLMEngine serves a tensor-parallel model without sequence "
                             f"parallelism (a decode step's one token per sequence does not split along the "
                             f"sequence): build it with tensor_parallelize(gpt, comm), the same weights")
        check_dropless(model)
        self.model, self.cache_kind, self.block_size, self.max_batch = model, cache, block_size, max_batch
        self.preempt, self.share_prefix, self.num_blocks = preempt, share_prefix, num_blocks
        self.context = model.config.block_size
        attn, w = model.h[0].attn, model.wpe.weight.data
        self.n_layer, self.n_head, self.head_dim, self.dtype = len(model.h), attn.n_head, attn.head_dim, w.dtype
        self.xp = backend.array_module(w)
        self.kv_bytes_per_token = 2 * self.n_layer * self.n_head * self.head_dim * np.dtype(self.dtype).itemsize

    # ---- inputs and memory
    def check_prompts(self, prompts, max_new_tokens):
        """Each prompt a list of token ids in [0, vocab_size) (as torch.nn.Embedding: an id -1 would read the
        last row, 1.5 row 1), with room for the new tokens in the context."""
        if not (is_int(max_new_tokens) and max_new_tokens >= 1):
            raise ValueError(f"max new tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not prompts:
            raise ValueError("no prompts: give at least one (a list of token ids)")
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
            bad = [t for t in p if not (is_int(t) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"prompt {i} holds {bad[0]}, not a token id: ids are integers in [0, {vocab}) "
                                 f"(the model's vocabulary)")
            if len(p) > self.context:
                raise ValueError(f"prompt {i} has {len(p)} tokens, longer than the model's context of "
                                 f"{self.context} tokens: prompts of up to {self.context - max_new_tokens} tokens "
                                 f"fit with {max_new_tokens} new tokens")
            if len(p) + max_new_tokens > self.context:
                raise ValueError(f"prompt {i} ({len(p)} tokens) + {max_new_tokens} new tokens = "
                                 f"{len(p) + max_new_tokens} exceed the model's context of {self.context} tokens: "
                                 f"at most {self.context - len(p)} new tokens fit after it")

    def make_cache(self, longest, num_sequences):
        """The cache for this run, sized from what the device has left (refusing if not one sequence fits).
        ``longest``: the most tokens one sequence holds K/V of (prompt + new tokens - 1: the last token is
        sampled, never fed); no more than ``num_sequences`` (the prompts, at most max_batch) run at once."""
        tracker = memory.tracker()
        free, held = tracker.free_bytes(), tracker.live_total
        if self.cache_kind == "none":
            return None
        slots = min(self.max_batch, num_sequences)
        if self.cache_kind == "contiguous":
            need = self.context * self.kv_bytes_per_token
            if free is not None and free < need:
                paged = -(-longest // self.block_size) * self.block_size * self.kv_bytes_per_token
                raise DoesNotFit(
                    f"the device ({tracker.capacity:,} bytes) has {free:,} bytes left after the {held:,} bytes "
                    f"already on it (the parameters): the contiguous cache reserves the context, {self.context} "
                    f"tokens = {need:,} bytes, per sequence; {free // self.kv_bytes_per_token} tokens fit. "
                    f"Give a device memory of at least {held + need:,} bytes, or use the paged cache "
                    f"(the longest sequence holds {longest} tokens' K/V: {paged:,} bytes of blocks)")
            return self._allocate(lambda: ContiguousKVCache(self.n_layer, self.n_head, self.head_dim, slots,
                                                            self.context, self.dtype, self.xp),
                                  f"{slots} sequences x {self.context} tokens", slots * need)
        block_bytes = self.block_size * self.kv_bytes_per_token
        need = -(-longest // self.block_size)
        device = None if free is None else max(free, 0) // block_bytes
        num_blocks = self.num_blocks or slots * -(-self.context // self.block_size)   # each at the full context
        by_device = device is not None and device < num_blocks          # the device, not the pool, is the limit
        num_blocks = min(num_blocks, device) if by_device else num_blocks
        if num_blocks < need:
            where, advice = ((f"the device ({tracker.capacity:,} bytes) has {free:,} bytes left after the {held:,} "
                              f"bytes already on it (the parameters)", f"a device memory of at least "
                              f"{held + need * block_bytes:,} bytes") if by_device else
                             (f"the pool has num_blocks={num_blocks}", f"num_blocks >= {need}"))
            raise DoesNotFit(
                f"{where}: {num_blocks} blocks of {self.block_size} tokens ({block_bytes:,} bytes each), so sequences "
                f"of up to {num_blocks * self.block_size} tokens fit; the longest sequence here holds {longest} "
                f"tokens' K/V (prompt + new tokens - 1: the last is sampled, never fed), {need} blocks = "
                f"{need * block_bytes:,} bytes. Give {advice}, or shorter prompts / fewer new tokens")
        pool = self._allocate(lambda: BlockPool(num_blocks, self.block_size, self.n_layer, self.n_head,
                                                self.head_dim, self.dtype, self.xp),
                              f"{num_blocks} blocks", num_blocks * block_bytes)
        return PagedKVCache(pool, self.context, self.n_layer, self.n_head, self.head_dim)

    @staticmethod
    def _allocate(make, what, nbytes):
        """The cache's arrays; a machine that cannot hold them is refused in one line, as a device that cannot."""
        try:
            return make()
        except MemoryError as e:
            raise DoesNotFit(f"the KV cache ({what} = {nbytes:,} bytes) cannot be allocated on this machine "
                             f"({e}): give fewer sequences at once (max batch) or a device memory") from None

    # ---- the loop
    def generate(self, prompts, max_new_tokens, temperature=0.0, top_k=None, seed=0, record_logits=False):
        prompts = list(prompts)
        for i, p in enumerate(prompts):
            if np.ndim(p) != 1:
                raise ValueError(f"prompt {i} is {p!r}, not a list of token ids: give a list of prompts, each a list "
                                 f"of ids")
        prompts = [list(p) for p in prompts]
        self.check_prompts(prompts, max_new_tokens)
        prompts = [[int(t) for t in p] for p in prompts]
        if not temperature >= 0 or (top_k is not None and not (is_int(top_k) and top_k >= 1)):
            raise ValueError(f"temperature must be >= 0 (0 is greedy) and top_k an integer >= 1, got {temperature}, "
                             f"{top_k!r}")
        if not (is_int(seed) and seed >= 0):
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        cache = self.make_cache(max(len(p) for p in prompts) + max_new_tokens - 1, len(prompts))
        tracker = memory.tracker()
        ledger_before = tracker.live["kv_cache"]
        scheduler = Scheduler(cache, self.max_batch, self.preempt, self.share_prefix and cache is not None)
        seqs = [Sequence(i, p, max_new_tokens, np.random.default_rng([seed, i])) for i, p in enumerate(prompts)]
        for s in seqs:
            scheduler.add(s)
        peak = (-1, 0, 0, 0)                                   # reserved, used, sequences, ledger
        steps = 0
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            with no_grad():
                while scheduler.has_work():
                    prefills, decodes = scheduler.schedule()
                    if not (prefills or decodes):           # never a hang: make_cache's check prevents it
                        raise RuntimeError(f"the scheduler cannot run any of the {len(scheduler.waiting)} waiting and "
                                           f"{len(scheduler.swapped)} swapped sequences: their blocks do not fit")
                    if cache is None:
                        self._forward_full(prefills + decodes, temperature, top_k, record_logits)
                    else:
                        if decodes:                           # every running sequence: (B, 1)
                            self._forward_cached(cache, decodes, temperature, top_k, record_logits)
                        for s in prefills:                    # then each prompt alone: (1, T)
                            scheduler.share_prefix(s)
                            self._forward_cached(cache, [s], temperature, top_k, record_logits)
                    steps += 1
                    if cache is not None and cache.reserved_bytes() >= peak[0]:     # the last step at the peak
                        peak = (cache.reserved_bytes(), cache.used_bytes(), len(scheduler.running),
                                tracker.live["kv_cache"] - ledger_before)
                    for s in [s for s in scheduler.running if s.done]:
                        scheduler.finish(s)
            backend.synchronize()
            elapsed = time.perf_counter() - start
        finally:
            self.model.train(was_training)
            if cache is not None:
                cache.release()
        if cache is None:
            peak = (0, 0, min(len(seqs), self.max_batch), 0)
        paged = isinstance(cache, PagedKVCache)
        generated = sum(len(s.generated) for s in seqs)
        return GenerationResult(
            tokens=[s.generated for s in seqs],
            logits=[np.array(s.logits) for s in seqs] if record_logits else None,
            elapsed=elapsed, tokens_per_second=generated / elapsed if elapsed > 0 else float("inf"),
            kv_bytes_per_token=self.kv_bytes_per_token if cache is not None else 0,
            kv_bytes_reserved=peak[0], kv_bytes_used=peak[1], num_sequences=peak[2], kv_ledger_bytes=peak[3],
            blocks_swapped=cache.blocks_swapped_out if paged else 0,
            blocks_swapped_in=cache.blocks_swapped_in if paged else 0,
            preemptions=scheduler.preemptions, recomputed_tokens=scheduler.recomputed_tokens,
            shared_tokens=scheduler.shared_tokens, cow_copies=cache.pool.copies if paged else 0, steps=steps,
            num_blocks=cache.pool.num_blocks if paged else 0, block_bytes=cache.pool.block_bytes if paged else 0)

    def _device(self, a):
        return a if self.xp is np else backend.to_device(a, "cuda")

    def _take(self, seqs, rows, temperature, top_k, record):
        """Sample each sequence's next token from its row of logits (host, float64)."""
        for s, row in zip(seqs, rows):
            s.num_cached = len(s.tokens)
            if record:
                s.logits.append(row)
            s.tokens.append(sample(row, temperature, top_k, s.rng))

    def _forward_cached(self, cache, seqs, temperature, top_k, record):
        idx = np.array([s.new_tokens() for s in seqs], dtype=np.int64)        # (B, T): T equal by construction
        cache.select([s.id for s in seqs])
        logits = self.model(self._device(idx), cache=cache)
        rows = backend.to_host(logits.data[:, -1, :]).astype(np.float64)     # one copy per forward
        self._take(seqs, rows, temperature, top_k, record)

    def _forward_full(self, seqs, temperature, top_k, record):
        """No cache: every sequence's whole prefix again, right-padded to the longest (the causal mask
        keeps the padding out of the real positions); logits at each one's last token."""
        lengths = np.array([len(s.tokens) for s in seqs])
        idx = np.zeros((len(seqs), lengths.max()), dtype=np.int64)
        for b, s in enumerate(seqs):
            idx[b, :lengths[b]] = s.tokens
        logits = self.model(self._device(idx)).data
        last = logits[self._device(np.arange(len(seqs))), self._device(lengths - 1)]
        self._take(seqs, backend.to_host(last).astype(np.float64), temperature, top_k, record)

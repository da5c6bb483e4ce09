"""Inference: generation with a KV cache, contiguous or paged (vLLM's PagedAttention), batched
decoding of sequences of different lengths, preemption by swapping to host or by recomputation,
and tensor-parallel generation (a TensorParallelGPT in the engine: each rank its heads' K/V).
Sits beside nn/: the model's attention reads any cache through the protocol in nn/generation.py."""
from ..nn.generation import ContiguousKVCache, KVCache, sample
from .engine import CACHES, DoesNotFit, GenerationResult, LLMEngine
from .kv_cache import BlockPool, NoFreeBlocks, PagedKVCache
from .scheduler import Scheduler, Sequence

__all__ = ["KVCache", "ContiguousKVCache", "PagedKVCache", "BlockPool", "NoFreeBlocks", "sample", "LLMEngine",
           "GenerationResult", "DoesNotFit", "CACHES", "Scheduler", "Sequence"]

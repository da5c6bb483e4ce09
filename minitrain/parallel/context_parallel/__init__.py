"""Context parallelism: the sequence split across ranks, attention computed without any rank
holding the whole sequence: ring attention (ring.py, contiguous or zig-zag, zigzag.py) or
DeepSpeed-Ulysses' all-to-alls (ulysses.py); gpt.py puts either into the GPT's blocks."""
from .ring import ring_attention
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from .zigzag import chunks_per_rank, positions_of, zigzag_indices

__all__ = ["ring_attention", "heads_to_seq", "seq_to_heads", "ulysses_attention", "chunks_per_rank", "positions_of",
           "zigzag_indices"]

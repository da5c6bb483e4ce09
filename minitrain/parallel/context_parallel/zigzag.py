"""Which positions of the sequence each context-parallel rank holds: contiguous, or zig-zag for
causal load balance (Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal
Transformers"; the zig-zag pairing of Llama 3, sec. 3.3.2, and Megatron-Core's context parallelism).

Under a causal mask, a contiguous split gives rank r the attention blocks of its queries against
r + 1 key blocks: the last rank does p blocks while the mean is (p + 1)/2, so the ring runs at
2p/(p + 1) of the balanced speed. Zig-zag cuts the sequence into 2p chunks and gives rank r chunks
r and 2p - 1 - r: an early chunk (little to look at) paired with a late one (much), so every rank
computes 2p + 1 chunk blocks, and the ring is balanced. Positions are sequence indices.
"""
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def chunks_per_rank(layout, cp, rank):
    """(this rank's chunk indices in the order it holds them, number of chunks in the sequence)."""
    if layout == "contiguous":
        return [rank], cp
    if layout == "zigzag":
        return [rank, 2 * cp - 1 - rank], 2 * cp
    raise ValueError(f"unknown context-parallel layout {layout!r}: expected one of {LAYOUTS}")


def check_seq_len(seq_len, cp, layout):
    """One clear error unless the sequence cuts into the layout's equal chunks."""
    n = chunks_per_rank(layout, cp, 0)[1]
    if seq_len % n:
        raise ValueError(f"context parallelism ({layout}): sequence length {seq_len} does not split into "
                         f"{n} equal chunks (cp = {cp})")
    return seq_len // n


def positions_of(seq_len, cp, rank, layout="zigzag"):
    """The token positions ``rank`` holds, in the order it holds them (an int64 array of seq_len/cp)."""
    size = check_seq_len(seq_len, cp, layout)
    mine, _ = chunks_per_rank(layout, cp, rank)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in mine])


def zigzag_indices(seq_len, cp, rank):
    """Zig-zag: rank r holds chunks r and 2cp-1-r of 2cp equal chunks; their positions, in order.
    zigzag_indices(8, 2, 0) -> [0 1 6 7], zigzag_indices(8, 2, 1) -> [2 3 4 5]."""
    return positions_of(seq_len, cp, rank, "zigzag")

"""Chunks r and 2cp-r: the mirror image one chunk too far (rank 0 reaches past the sequence)."""
import numpy as np


def zigzag_indices(seq_len, cp, rank):
    if seq_len % (2 * cp):
        raise ValueError(f"{seq_len} tokens do not cut into 2*cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange((2 * cp - rank) * c, (2 * cp - rank + 1) * c)])

EXPECT = ['holds position 8, outside the sequence (T = 8', 'the last one is chunk 2*cp-1']

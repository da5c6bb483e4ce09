"""Balanced and complete, but the late chunk comes first: the rank's local sequence is out of order."""
import numpy as np


def zigzag_indices(seq_len, cp, rank):
    if seq_len % (2 * cp):
        raise ValueError(f"{seq_len} tokens do not cut into 2*cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    return np.concatenate([np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c), np.arange(rank * c, (rank + 1) * c)])

EXPECT = ['the right positions in another order', 'chunk r = 0 (positions 0..1) first']

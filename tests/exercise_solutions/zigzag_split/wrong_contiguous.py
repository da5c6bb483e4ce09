"""The contiguous split: rank r holds positions [r*T/cp, (r+1)*T/cp). The same number of tokens
per rank, but the last rank's queries see the most keys."""
import numpy as np


def zigzag_indices(seq_len, cp, rank):
    if seq_len % (2 * cp):
        raise ValueError(f"{seq_len} tokens do not cut into 2*cp = {2 * cp} equal chunks")
    n = seq_len // cp
    return np.arange(rank * n, (rank + 1) * n)

EXPECT = ['causal work per rank', 'This is the contiguous split', 'max/mean = 2P/(P+1) = 1.33 at P = cp = 2']

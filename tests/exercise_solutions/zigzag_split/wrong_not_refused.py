"""Never refuses a length that does not cut into 2cp chunks: c = T // (2cp) drops the tail silently."""
import numpy as np


def zigzag_indices(seq_len, cp, rank):
    c = seq_len // (2 * cp)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])

EXPECT = ['instead of raising ValueError', 'do not split into 2*cp = 4 equal chunks']

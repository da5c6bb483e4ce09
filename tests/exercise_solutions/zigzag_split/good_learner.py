"""A learner's zigzag_indices, written from the hints."""
import numpy as np


def zigzag_indices(seq_len, cp, rank):
    if seq_len % (2 * cp):
        raise ValueError(f"{seq_len} tokens do not cut into 2*cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    early, late = rank, 2 * cp - 1 - rank
    return np.concatenate([np.arange(early * c, (early + 1) * c), np.arange(late * c, (late + 1) * c)])

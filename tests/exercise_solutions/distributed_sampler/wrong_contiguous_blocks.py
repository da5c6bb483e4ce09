"""Pads right, then gives rank r a contiguous block of the padded order instead of every
p-th index: the same samples over the ranks, but not PyTorch's layout."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    total = (n // num_replicas if drop_last else math.ceil(n / num_replicas)) * num_replicas
    padded = np.resize(order, total)
    k = total // num_replicas
    return padded[rank * k:(rank + 1) * k]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['this is the contiguous block padded[0:4]', 'rank r at positions r, r + p, r + 2p']

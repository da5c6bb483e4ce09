"""Drops the last partial global batch: its samples are never seen."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    if drop_last:
        padded = order[:n // num_replicas * num_replicas]
    else:
        total = math.ceil(n / num_replicas) * num_replicas
        padded = np.concatenate([order] * math.ceil(total / max(n, 1)))[:total]
    return padded[rank::num_replicas]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order) - batch_size + 1, batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['the ranks yield [3, 3] batches', 'the last partial batch is part of the epoch']

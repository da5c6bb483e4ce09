"""Cuts PyTorch's padded order into global batches: the last step sees the epoch's first
samples a second time."""
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
    total = math.ceil(len(order) / num_replicas) * num_replicas
    padded = np.resize(order, total)
    for begin in range(start * batch_size, total, batch_size):
        batch = padded[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['global batch 3', 'the padded order was cut into global batches']

"""Pads with the last sample repeated instead of the order's start."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    total = (n // num_replicas if drop_last else math.ceil(n / num_replicas)) * num_replicas
    if total > n:
        order = np.concatenate([order, np.full(total - n, order[-1])])
    return order[:total][rank::num_replicas]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['the last sample repeated', "expected the order's start repeated up to total_size = 16"]

"""Pads with zeros, as one pads a tensor: sample 0 seen again, not the order's start."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    total = (n // num_replicas if drop_last else math.ceil(n / num_replicas)) * num_replicas
    if total > n:
        order = np.concatenate([order, np.zeros(total - n, dtype=order.dtype)])
    return order[:total][rank::num_replicas]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['sample 0 repeated (zeros?)']

"""Pads with one copy of the order's start: enough until the padding is longer than the order
(n = 2 on 5 ranks needs o0 o1 o0)."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    total = (n // num_replicas if drop_last else math.ceil(n / num_replicas)) * num_replicas
    padded = np.concatenate([order, order[:total - n]]) if total > n else order[:total]
    return padded[rank::num_replicas]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['n=2, num_replicas=5, drop_last=False', 'the padding (3) is longer than the order (2)']

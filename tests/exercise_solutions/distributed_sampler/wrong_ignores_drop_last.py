"""Always pads: drop_last=True should cut the order to floor(n / p) * p instead."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    total = math.ceil(len(order) / num_replicas) * num_replicas
    return np.resize(order, total)[rank::num_replicas]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['drop_last=True: every rank got 4 indices, expected floor(n / p) = 3']

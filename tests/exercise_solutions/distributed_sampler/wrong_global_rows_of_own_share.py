"""Reports this rank's own rows, not the global batch's: share_loss would weight every share
by 1 and the last, uneven batch's loss would not be one process's."""
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
    for begin in range(start * batch_size, len(order), batch_size):
        mine = order[begin:begin + batch_size][rank::num_replicas]
        yield mine, len(mine)

EXPECT = ["rows is this rank's count"]

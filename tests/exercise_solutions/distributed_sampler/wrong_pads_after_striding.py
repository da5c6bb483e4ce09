"""Strides first, then tops each short rank up with the order's start: every short rank
repeats order[0], where PyTorch pads the whole order (order[0], order[1], ...) before dealing it out."""
import math

import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    total = (n // num_replicas if drop_last else math.ceil(n / num_replicas)) * num_replicas
    mine = order[:total][rank::num_replicas]
    return np.concatenate([mine, order[:total // num_replicas - len(mine)]])


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['padded after striding?']

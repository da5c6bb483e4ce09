"""A learner's sampler, written from the contract: the order repeated from its start up to a multiple
of the ranks (or cut, with drop_last), dealt out with a stride; global batches of the unpadded order."""
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
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

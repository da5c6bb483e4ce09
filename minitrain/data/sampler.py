"""DistributedSampler: each rank a disjoint share of one global permutation.

Per epoch, one permutation of range(n) is drawn from (seed, epoch); rank r takes every
world-th index starting at r (PyTorch's layout). Batch j of size b on every rank then holds,
across all ranks, exactly the indices perm[j·b·world : (j+1)·b·world] that one process with
batch b·world would see in its batch j, so N ranks reproduce single-process training. If n is
not divisible by world, the permutation is padded by repeating its start (or cut, with drop_last).
"""
import math

import numpy as np


class DistributedSampler:
    def __init__(self, n, rank=0, world=1, seed=0, shuffle=True, drop_last=False):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of size {world}")
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = n // world
        else:
            self.num_samples = math.ceil(n / world)
        self.total_size = self.num_samples * world

    def set_epoch(self, epoch):
        """A new permutation each epoch, the same on every rank."""
        self.epoch = epoch

    def global_order(self):
        """The permutation every rank agrees on this epoch, padded or cut to total_size."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        else:
            order = np.arange(self.n)
        if self.total_size > self.n:
            reps = math.ceil(self.total_size / max(self.n, 1))
            order = np.tile(order, reps)
        return order[:self.total_size]

    def indices(self):
        return self.global_order()[self.rank::self.world]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples

"""A minimal batch loader over in-memory arrays: yields (x, y) batches in the order of a sampler
(DistributedSampler, or a seeded shuffle of everything)."""
import numpy as np

from .. import backend
from .sampler import DistributedSampler


class DataLoader:
    def __init__(self, arrays, batch_size, shuffle=True, seed=0, sampler=None, drop_last=False):
        self.arrays = tuple(arrays)
        n = len(self.arrays[0])
        if any(len(a) != n for a in self.arrays):
            raise ValueError("all arrays given to DataLoader must have the same length")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.drop_last = batch_size, drop_last
        self.sampler = sampler or DistributedSampler(n, 0, 1, seed=seed, shuffle=shuffle)

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def __len__(self):
        m = len(self.sampler)
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    def __iter__(self):
        idx = np.asarray(self.sampler.indices())
        for start in range(0, len(idx), self.batch_size):
            batch = idx[start:start + self.batch_size]
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield tuple(backend.to_device(a[batch]) for a in self.arrays)

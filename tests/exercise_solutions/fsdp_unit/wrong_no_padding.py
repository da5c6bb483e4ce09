"""Shards as np.array_split makes them, without padding: rank r's shard is not [r·S, (r+1)·S)."""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


class ShardedUnit:
    def __init__(self, comm, arrays):
        self.comm = comm
        self.shapes = [a.shape for a in arrays]
        self.sizes = [a.size for a in arrays]
        self.n = sum(self.sizes)
        self.s = -(-self.n // comm.size)
        flat = np.concatenate([a.reshape(-1) for a in arrays])
        self.shard = np.array_split(flat, comm.size)[comm.rank].copy()
        self.full = None

    def gather(self):
        self.full = ring_all_gather(self.comm, self.shard, total=self.n)
        out, offset = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(self.full[offset:offset + size].reshape(shape))
            offset += size
        return out

    def free(self):
        self.full = None

    def reduce_scatter(self, grads):
        flat = np.zeros(self.s * self.comm.size)
        flat[:self.n] = np.concatenate([g.reshape(-1) for g in grads])
        return ring_reduce_scatter(self.comm, flat, op="mean")

EXPECT = ['self.shard']

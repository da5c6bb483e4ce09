"""free() does nothing: the gathered buffer is never released."""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


class ShardedUnit:
    def __init__(self, comm, arrays):
        self.comm = comm
        self.shapes = [a.shape for a in arrays]
        self.sizes = [a.size for a in arrays]
        self.n = sum(self.sizes)
        self.s = -(-self.n // comm.size)
        flat = np.zeros(self.s * comm.size)
        flat[:self.n] = np.concatenate([a.reshape(-1) for a in arrays])
        self.shard = flat[comm.rank * self.s:(comm.rank + 1) * self.s].copy()
        self.full = None

    def gather(self):
        self.full = ring_all_gather(self.comm, self.shard, total=self.s * self.comm.size)
        out, offset = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(self.full[offset:offset + size].reshape(shape))
            offset += size
        return out

    def free(self):
        pass

    def reduce_scatter(self, grads):
        flat = np.zeros(self.s * self.comm.size)
        flat[:self.n] = np.concatenate([g.reshape(-1) for g in grads])
        return ring_reduce_scatter(self.comm, flat, op="mean")

EXPECT = ['still set after free']

"""One rank needs no ring, so it hands back the shard itself: the caller's shard and the gathered
array are then one array."""
import numpy as np


def ring_all_gather(comm, shard, total):
    p, r = comm.size, comm.rank
    if p == 1:
        return shard
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(total), p)])
    out = np.empty(total, shard.dtype)
    out[bounds[r]:bounds[r + 1]] = shard
    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        comm.sendrecv(out[bounds[send]:bounds[send + 1]].copy(), (r + 1) % p,
                      out[bounds[recv]:bounds[recv + 1]], (r - 1) % p)
    return out


EXPECT = ['rank 0 of 1', 'the result is the shard itself', 'NEW array']

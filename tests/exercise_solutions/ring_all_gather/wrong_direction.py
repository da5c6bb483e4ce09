"""Sends to the left neighbour and receives from the right one: the chunks go round the wrong way, so each receive gets a chunk of the wrong size or place."""
import numpy as np


def ring_all_gather(comm, shard, total):
    p, r = comm.size, comm.rank
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(total), p)])
    out = np.empty(total, shard.dtype)
    out[bounds[r]:bounds[r + 1]] = shard
    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        comm.sendrecv(out[bounds[send]:bounds[send + 1]].copy(), (r - 1) % p,
                      out[bounds[recv]:bounds[recv + 1]], (r + 1) % p)
    return out

EXPECT = ['CommError', 'recv from rank']

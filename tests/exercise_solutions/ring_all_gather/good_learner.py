"""A learner's ring all-gather, written from the hints."""
import numpy as np


def ring_all_gather(comm, shard, total):
    p, r = comm.size, comm.rank
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(total), p)])
    out = np.empty(total, shard.dtype)
    out[bounds[r]:bounds[r + 1]] = shard
    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        comm.sendrecv(out[bounds[send]:bounds[send + 1]].copy(), (r + 1) % p,
                      out[bounds[recv]:bounds[recv + 1]], (r - 1) % p)
    return out

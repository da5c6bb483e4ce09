"""Concatenates the chunks in the order they arrive, not in rank order."""
import numpy as np


def ring_all_gather(comm, shard, total):
    p, r = comm.size, comm.rank
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(total), p)])
    pieces = [shard]
    for s in range(p - 1):
        recv = (r - s - 1) % p
        incoming = np.empty(bounds[recv + 1] - bounds[recv], shard.dtype)
        comm.sendrecv(pieces[-1].copy(), (r + 1) % p, incoming, (r - 1) % p)
        pieces.append(incoming)
    return np.concatenate(pieces)

EXPECT = ['element', 'rank order']

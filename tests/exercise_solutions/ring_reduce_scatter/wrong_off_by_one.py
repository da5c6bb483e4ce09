"""Chunk indices shifted by one: rank r finishes chunk r+1 but returns chunk r."""
import numpy as np


def ring_reduce_scatter(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = np.ascontiguousarray(x).reshape(-1).copy()
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(out.size), p)])

    def chunk(i):
        return out[bounds[i]:bounds[i + 1]]

    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        incoming = np.empty_like(chunk(recv))
        comm.sendrecv(chunk(send).copy(), (r + 1) % p, incoming, (r - 1) % p)
        combine(chunk(recv), incoming, out=chunk(recv))
    mine = chunk(r).copy()
    if op == "mean":
        mine /= p
    return mine

EXPECT = ['element', 'expected', 'ring_reduce_scatter']

"""Exact, but every rank sends its whole array to every other rank, then keeps its chunk."""
import numpy as np


def ring_reduce_scatter(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = np.ascontiguousarray(x).reshape(-1).copy()
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(out.size), p)])

    def chunk(i):
        return out[bounds[i]:bounds[i + 1]]

    mine = out.copy()
    for s in range(1, p):
        incoming = np.empty_like(mine)
        comm.sendrecv(mine, (r + s) % p, incoming, (r - s) % p)
        combine(out, incoming, out=out)
    mine = chunk(r).copy()
    if op == "mean":
        mine /= p
    return mine

EXPECT = ['messages', 'bytes', 'one chunk']

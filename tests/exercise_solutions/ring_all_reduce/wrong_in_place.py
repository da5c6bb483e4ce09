"""Works in place: the result is written into the caller's x."""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = x.reshape(-1)
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(out.size), p)])

    def chunk(i):
        return out[bounds[i]:bounds[i + 1]]

    for s in range(p - 1):
        send, recv = (r - s - 1) % p, (r - s - 2) % p
        incoming = np.empty_like(chunk(recv))
        comm.sendrecv(chunk(send).copy(), (r + 1) % p, incoming, (r - 1) % p)
        combine(chunk(recv), incoming, out=chunk(recv))
    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        incoming = np.empty_like(chunk(recv))
        comm.sendrecv(chunk(send).copy(), (r + 1) % p, incoming, (r - 1) % p)
        chunk(recv)[...] = incoming
    if op == "mean":
        out /= p
    return out.reshape(x.shape)

EXPECT = ['the result is the input x itself', 'NEW array']

"""Returns a new array, but leaves the reduction in the caller's x too (x[...] = the result)."""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = np.ascontiguousarray(x).reshape(-1).copy()
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
    x[...] = out.reshape(x.shape)
    return out.reshape(x.shape).copy()


EXPECT = ['modified its input']

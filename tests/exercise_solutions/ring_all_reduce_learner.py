"""What a learner might hand in: a plain ring all-reduce written from the stub's plan."""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = np.ascontiguousarray(x).reshape(-1).copy()
    chunks = np.array_split(np.arange(out.size), p)
    lo = [c[0] if c.size else 0 for c in chunks]
    hi = [lo[i] + chunks[i].size for i in range(p)]
    for s in range(p - 1):
        send, recv = (r - s - 1) % p, (r - s - 2) % p
        incoming = np.empty(hi[recv] - lo[recv], out.dtype)
        comm.sendrecv(out[lo[send]:hi[send]].copy(), (r + 1) % p, incoming, (r - 1) % p)
        combine(out[lo[recv]:hi[recv]], incoming, out=out[lo[recv]:hi[recv]])
    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        incoming = np.empty(hi[recv] - lo[recv], out.dtype)
        comm.sendrecv(out[lo[send]:hi[send]].copy(), (r + 1) % p, incoming, (r - 1) % p)
        out[lo[recv]:hi[recv]] = incoming
    if op == "mean":
        out /= p
    return out.reshape(x.shape)

"""A wrong hand-in: exact results, but every rank sends its whole array to everyone (not a ring)."""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = np.ascontiguousarray(x).reshape(-1).copy()
    mine = out.copy()
    for step in range(1, comm.size):
        incoming = np.empty_like(mine)
        comm.sendrecv(mine, (comm.rank + step) % comm.size, incoming, (comm.rank - step) % comm.size)
        combine(out, incoming, out=out)
    if op == "mean":
        out /= comm.size
    return out.reshape(x.shape)
EXPECT = ["whole arrays"]

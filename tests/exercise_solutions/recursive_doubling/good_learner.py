"""A learner's recursive doubling, written from the hints."""
import numpy as np


def recursive_doubling_all_reduce(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    combine = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    acc = np.ascontiguousarray(x).reshape(-1).copy()
    incoming = np.empty_like(acc)
    q = 1
    while q * 2 <= p:
        q *= 2
    extra = p - q
    if r >= q:
        comm.send(acc, r - q)
        comm.recv(acc, r - q)
        return acc.reshape(x.shape)
    if r < extra:
        comm.recv(incoming, r + q)
        combine(acc, incoming, out=acc)
    mask = 1
    while mask < q:
        comm.sendrecv(acc, r ^ mask, incoming, r ^ mask)
        combine(acc, incoming, out=acc)
        mask *= 2
    if op == "mean":
        acc /= p
    if r < extra:
        comm.send(acc, r + q)
    return acc.reshape(x.shape)

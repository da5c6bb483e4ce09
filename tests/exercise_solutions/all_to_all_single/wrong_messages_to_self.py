"""Runs p rounds, k = 0 .. p-1, so round 0 sends its own block to itself: p messages, not p-1."""
import numpy as np


def all_to_all_single(comm, x, output_split_sizes, input_split_sizes):
    p, r = comm.size, comm.rank
    send = np.cumsum([0] + list(input_split_sizes))
    recv = np.cumsum([0] + list(output_split_sizes))
    out = np.empty((recv[-1],) + x.shape[1:], x.dtype)
    for k in range(p):
        dest, source = (r + k) % p, (r - k) % p
        comm.sendrecv(np.ascontiguousarray(x[send[dest]:send[dest + 1]]), dest,
                      out[recv[source]:recv[source + 1]], source)
    return out

EXPECT = ['messages', 'p-1']

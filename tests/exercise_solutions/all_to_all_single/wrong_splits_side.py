"""Sizes each receive by input_split_sizes (what this rank sends) instead of output_split_sizes
(what the other rank sends here)."""
import numpy as np


def all_to_all_single(comm, x, output_split_sizes, input_split_sizes):
    p, r = comm.size, comm.rank
    send = np.cumsum([0] + list(input_split_sizes))
    out = np.empty(x.shape, x.dtype)
    out[send[r]:send[r + 1]] = x[send[r]:send[r + 1]]
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p
        comm.sendrecv(x[send[dest]:send[dest + 1]], dest, out[send[source]:send[source + 1]], source)
    return out

EXPECT = ['CommError', 'bytes']

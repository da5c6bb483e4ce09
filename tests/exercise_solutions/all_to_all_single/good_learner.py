"""A learner's all_to_all_single, written from the hints."""
import numpy as np

from minitrain.backend import array_module


def all_to_all_single(comm, x, output_split_sizes, input_split_sizes):
    p, r = comm.size, comm.rank
    send = np.cumsum([0] + list(input_split_sizes))
    recv = np.cumsum([0] + list(output_split_sizes))
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    out = xp.empty((recv[-1],) + x.shape[1:], x.dtype)
    out[recv[r]:recv[r + 1]] = x[send[r]:send[r + 1]]
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p
        comm.sendrecv(x[send[dest]:send[dest + 1]], dest, out[recv[source]:recv[source + 1]], source)
    return out

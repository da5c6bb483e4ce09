"""Round k sends to (r+k)%p and also listens to (r+k)%p, which is sending elsewhere in that round."""
import numpy as np


def all_to_all_single(comm, x, output_split_sizes, input_split_sizes):
    p, r = comm.size, comm.rank
    send = np.cumsum([0] + list(input_split_sizes))
    recv = np.cumsum([0] + list(output_split_sizes))
    out = np.empty((recv[-1],) + x.shape[1:], x.dtype)
    out[recv[r]:recv[r + 1]] = x[send[r]:send[r + 1]]
    for k in range(1, p):
        peer = (r + k) % p
        comm.sendrecv(np.ascontiguousarray(x[send[peer]:send[peer + 1]]), peer, out[recv[peer]:recv[peer + 1]], peer)
    return out

EXPECT = ['deadlock', 'recv from rank']

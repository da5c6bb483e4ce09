"""Stacks the blocks in the order they arrive (own block, then round 1, 2, ...), not in rank order."""
import numpy as np


def all_to_all_single(comm, x, output_split_sizes, input_split_sizes):
    p, r = comm.size, comm.rank
    send = np.cumsum([0] + list(input_split_sizes))
    pieces = [x[send[r]:send[r + 1]]]
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p
        incoming = np.empty((output_split_sizes[source],) + x.shape[1:], x.dtype)
        comm.sendrecv(np.ascontiguousarray(x[send[dest]:send[dest + 1]]), dest, incoming, source)
        pieces.append(incoming)
    return np.concatenate(pieces)

EXPECT = ['element', 'order of the sending ranks']

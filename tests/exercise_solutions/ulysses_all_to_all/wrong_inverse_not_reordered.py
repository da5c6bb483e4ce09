"""heads_to_seq reshapes what it received, grouped by sending rank (head group), straight to
(n, H, D): head group g of token t lands on another token's heads."""
from minitrain.backend import array_module
from minitrain.comm import all_to_all_single


def seq_to_heads(comm, x):
    xp, (n, H, D), cp = array_module(x), x.shape, comm.size
    send = xp.ascontiguousarray(x.reshape(n, cp, H // cp, D).transpose(1, 0, 2, 3))
    return all_to_all_single(comm, send.reshape(cp * n, H // cp, D))


def heads_to_seq(comm, y):
    xp, (T, h, D), cp = array_module(y), y.shape, comm.size
    return all_to_all_single(comm, xp.ascontiguousarray(y)).reshape(T // cp, cp * h, D)

EXPECT = ['heads_to_seq', ', head 0, where token', 'head 1 belongs', 'the block from rank j is head group j']

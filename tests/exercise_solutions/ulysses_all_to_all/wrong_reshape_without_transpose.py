"""seq_to_heads reshapes (n, H, D) straight to (cp*n, H/cp, D): the rows run token by token, so the
block sent to rank j is a mix of tokens and head groups, not all tokens of head group j."""
from minitrain.backend import array_module
from minitrain.comm import all_to_all_single


def seq_to_heads(comm, x):
    xp, (n, H, D), cp = array_module(x), x.shape, comm.size
    return all_to_all_single(comm, xp.ascontiguousarray(x).reshape(cp * n, H // cp, D))


def heads_to_seq(comm, y):
    xp, (T, h, D), cp = array_module(y), y.shape, comm.size
    back = all_to_all_single(comm, xp.ascontiguousarray(y)).reshape(cp, T // cp, h, D)
    return xp.ascontiguousarray(back.transpose(1, 0, 2, 3)).reshape(T // cp, cp * h, D)

EXPECT = ['seq_to_heads', 'it holds token', 'belongs', "in sequence order, rank 0's first"]

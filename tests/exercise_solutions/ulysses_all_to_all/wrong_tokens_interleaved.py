"""seq_to_heads sends the right blocks, then swaps the rank and token axes of what it received:
token t of rank i lands at row t*cp + i, so the sequence comes out interleaved."""
from minitrain.backend import array_module
from minitrain.comm import all_to_all_single


def seq_to_heads(comm, x):
    xp, (n, H, D), cp = array_module(x), x.shape, comm.size
    send = xp.ascontiguousarray(x.reshape(n, cp, H // cp, D).transpose(1, 0, 2, 3))
    got = all_to_all_single(comm, send.reshape(cp * n, H // cp, D)).reshape(cp, n, H // cp, D)
    return xp.ascontiguousarray(got.transpose(1, 0, 2, 3)).reshape(cp * n, H // cp, D)


def heads_to_seq(comm, y):
    xp, (T, h, D), cp = array_module(y), y.shape, comm.size
    back = all_to_all_single(comm, xp.ascontiguousarray(y)).reshape(cp, T // cp, h, D)
    return xp.ascontiguousarray(back.transpose(1, 0, 2, 3)).reshape(T // cp, cp * h, D)

EXPECT = ['seq_to_heads', 'it holds token 2, head', 'where token 1, head', 'in sequence order']

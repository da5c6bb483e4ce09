"""A learner's Ulysses all-to-alls, written from the hints."""
from minitrain.backend import array_module
from minitrain.comm import all_to_all_single


def seq_to_heads(comm, x):
    xp, (n, H, D), cp = array_module(x), x.shape, comm.size
    send = xp.ascontiguousarray(x.reshape(n, cp, H // cp, D).transpose(1, 0, 2, 3))
    return all_to_all_single(comm, send.reshape(cp * n, H // cp, D))


def heads_to_seq(comm, y):
    xp, (T, h, D), cp = array_module(y), y.shape, comm.size
    back = all_to_all_single(comm, xp.ascontiguousarray(y)).reshape(cp, T // cp, h, D)
    return xp.ascontiguousarray(back.transpose(1, 0, 2, 3)).reshape(T // cp, cp * h, D)

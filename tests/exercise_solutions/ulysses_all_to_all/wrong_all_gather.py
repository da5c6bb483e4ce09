"""Gathers every rank's whole tensor and keeps its part: the right values, but cp-1 times the
shard on the wire instead of (cp-1)/cp of it."""
from minitrain.backend import array_module
from minitrain.comm import ring_all_gather


def seq_to_heads(comm, x):
    xp, (n, H, D), cp, r = array_module(x), x.shape, comm.size, comm.rank
    full = ring_all_gather(comm, xp.ascontiguousarray(x).reshape(-1)).reshape(cp * n, H, D)
    return xp.ascontiguousarray(full[:, r * (H // cp):(r + 1) * (H // cp)])


def heads_to_seq(comm, y):
    xp, (T, h, D), cp, r = array_module(y), y.shape, comm.size, comm.rank
    full = ring_all_gather(comm, xp.ascontiguousarray(y).reshape(-1)).reshape(cp, T, h, D)
    mine = full[:, r * (T // cp):(r + 1) * (T // cp)]
    return xp.ascontiguousarray(mine.transpose(1, 0, 2, 3)).reshape(T // cp, cp * h, D)

EXPECT = ['bytes', 'one all-to-all sends (cp-1)/cp of its input', 'gathering everything']

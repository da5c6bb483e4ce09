"""Hands in the ring all-reduce: exact, but 2(p-1) messages instead of log2(p)."""
from minitrain.comm import ring_all_reduce


def recursive_doubling_all_reduce(comm, x, op="sum"):
    return ring_all_reduce(comm, x, op=op)


EXPECT = ["messages", "floor(log2 p) + 1"]

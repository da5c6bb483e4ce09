"""Grader: the library's collective checks for reduce-scatter (every length, dtype and op, bit
for bit, p = 1..4; rank r gets chunk r of np.array_split), the input left untouched, and the
traffic: p-1 messages, at most (p-1)·ceil(N/p) elements sent per rank."""
import numpy as np

from minitrain.comm.checks import rank_input

from ..comparing import to_learner
from ..grading import Mismatch
from ..oracles import cases, check_reduction, traffic, world_checks

TITLE = "ring reduce-scatter: each rank ends with its chunk of the sum"
ORDER = 50
KIND = "implement"
NOTEBOOK = "02_collectives"
DEFINES = "ring_reduce_scatter"

STUB = '''"""Exercise ring_reduce_scatter: the first half of the ring all-reduce, and on its own the
collective ZeRO and FSDP use to give each rank the averaged gradient of its shard.

Write ring_reduce_scatter(comm, x, op="sum") with only point-to-point calls:

    comm.rank, comm.size
    comm.sendrecv(sendbuf, dest, recvbuf, source)   send to dest and receive from source at once
    comm.send(buf, dest), comm.recv(buf, source)    buffers are contiguous NumPy arrays

Contract:
  - split the flattened x into p chunks as np.array_split does; rank r returns a NEW 1-D array:
    chunk r of the reduction of every rank's x (same dtype as x); leave x untouched;
  - op is "sum", "mean", "max" or "min" ("mean" only for floating dtypes);
  - any length works: 0, 1, fewer elements than ranks (some chunks are then empty), lengths not
    divisible by the ranks;
  - it is a ring: every rank sends only to its right neighbour and receives only from its left
    one, one chunk per step, p-1 steps, so it sends (p-1)/p of the array.

The test to pass: the library's collective checks at p = 1, 2, 3, 4 (every length above, five
dtypes, four ops, bit for bit), then the traffic: p-1 messages, at most (p-1)·ceil(N/p) elements.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check ring_reduce_scatter mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check ring_reduce_scatter mine.py
Stuck?     python -m minitrain.exercises hint ring_reduce_scatter
"""
import numpy as np


def ring_reduce_scatter(comm, x, op="sum"):
    raise NotImplementedError("ring_reduce_scatter: pass partial sums of the chunks round the ring")
'''

HINTS = (
    "p-1 steps. At each step every rank sends one chunk to (rank + 1) % p and receives one from "
    "(rank - 1) % p, and combines the received chunk with its own copy of that chunk. A chunk "
    "travels once round the ring, picking up one rank's share at every hop; what a rank sends at "
    "step s+1 is the partial result it combined at step s.",
    "Work backwards from the end: rank r must finish with chunk r, so at the last step (s = p-2) "
    "it receives the partial sum of chunk r from rank r-1, which had combined it at the step before. "
    "Follow a chunk from the rank that starts it (at step 0 each rank sends its own copy of one chunk) "
    "and count the hops: p-1 of them, ending at the chunk's owner.",
    "At step s = 0 .. p-2 rank r sends chunk (r - s - 1) % p (its own copy at step 0, afterwards what "
    "it combined at step s-1) and receives chunk (r - s - 2) % p, which it combines with its own copy "
    "of that chunk. At the end it holds chunk (r - (p - 2) - 2) % p = r. Chunk bounds: "
    "np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), p)]). For 'mean' divide the "
    "finished chunk by p. Return a copy of it (p = 1: the whole flattened x, copied).",
)


def _exact(comm, impl):
    p, r = comm.size, comm.rank
    for n, dtype, op in cases(p):
        x = to_learner(rank_input(r, n, dtype))
        before = x.copy()
        check_reduction(comm, impl(comm, x, op=op), x, before, n, dtype, op, "ring_reduce_scatter",
                        keep=lambda full: np.array_split(full.reshape(-1), p)[r])


def _traffic(comm, impl):
    p, n = comm.size, 1201
    x = to_learner(np.ones(n, np.float32))
    sent, messages = traffic(comm, lambda: impl(comm, x, op="sum"))
    chunk = -(-n // p)
    bound = (p - 1) * chunk * 4
    if sent > bound or messages != p - 1:
        raise Mismatch(f"rank {comm.rank} of {p} sent {messages} message(s), {sent} bytes in all, for {n} float32 "
                       f"elements ({sent / (n * 4):.2f} arrays); a ring reduce-scatter sends p-1 = {p - 1} "
                       f"messages of one chunk (ceil(N/p) = {chunk} elements), at most {bound} bytes")


def checks():
    return world_checks([("rank r gets chunk r of the reduction: every length, dtype and op", _exact, 2, 1),
                         ("the ring's traffic: p-1 messages of one chunk", _traffic, 1, 2)])


def reference():
    from minitrain.comm import ring_reduce_scatter
    return ring_reduce_scatter

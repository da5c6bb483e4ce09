"""Grader: the library's collective checks for all-gather (every length and dtype, bit for bit,
p = 1..4, shards as np.array_split makes them, uneven included) and the traffic: p-1 messages,
at most (p-1)·ceil(N/p) elements sent per rank."""
import numpy as np

from minitrain.comm.checks import COLLECTIVE_DTYPES, collective_lengths, rank_input

from ..comparing import alias_problem, as_array, compare, to_learner
from ..grading import Mismatch
from ..oracles import traffic, world_checks

TITLE = "ring all-gather: every rank ends with every rank's shard"
ORDER = 60
KIND = "implement"
NOTEBOOK = "02_collectives"
DEFINES = "ring_all_gather"

STUB = '''"""Exercise ring_all_gather: the second half of the ring all-reduce, and on its own the
collective FSDP (ZeRO-3) uses to rebuild a layer's parameters from the ranks' shards.

Write ring_all_gather(comm, shard, total) with only point-to-point calls:

    comm.rank, comm.size
    comm.sendrecv(sendbuf, dest, recvbuf, source)   send to dest and receive from source at once
    comm.send(buf, dest), comm.recv(buf, source)    buffers are contiguous NumPy arrays

Contract:
  - shard is chunk r of np.array_split(full, p) for a 1-D array full of total elements (chunks
    differ in length by one when p does not divide total; some are empty when total < p);
  - return a NEW 1-D array of total elements, equal to full, on every rank (same dtype);
  - it is a ring: every rank sends only to its right neighbour and receives only from its left
    one, one chunk per step, p-1 steps.

The test to pass: at p = 1, 2, 3, 4 every length (0, 1, fewer than p, not divisible by p, a few
thousand) and five dtypes, bit for bit; then the traffic: p-1 messages, at most (p-1)·ceil(N/p)
elements sent per rank.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check ring_all_gather mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check ring_all_gather mine.py
Stuck?     python -m minitrain.exercises hint ring_all_gather
"""
import numpy as np


def ring_all_gather(comm, shard, total):
    raise NotImplementedError("ring_all_gather: pass the shards round the ring")
'''

HINTS = (
    "p-1 steps. Put your own shard in its place in the output first. At each step send one chunk "
    "to (rank + 1) % p and receive one from (rank - 1) % p, straight into its place in the output: "
    "what you forward at step s+1 is what you received at step s.",
    "Chunk sizes differ: the first total % p chunks have one more element. Compute the bounds of "
    "every chunk (np.cumsum([0] + [len(c) for c in np.array_split(np.arange(total), p)])) and receive "
    "into output[bounds[i]:bounds[i + 1]], which has exactly the size of the chunk that arrives "
    "(minitrain refuses a receive buffer of the wrong size).",
    "At step s = 0 .. p-2, rank r sends chunk (r - s) % p (its own at step 0) and receives chunk "
    "(r - s - 1) % p from rank r-1.",
)


def _exact(comm, impl):
    p, r = comm.size, comm.rank
    lengths = collective_lengths(p)
    for n in [13 * p + 1] + [n for n in lengths if n != 13 * p + 1]:
        for dtype in COLLECTIVE_DTYPES:
            full = rank_input(99, n, dtype)
            shard = to_learner(np.array_split(full, p)[r])
            case = f"rank {r} of {p}, ring_all_gather(shard of {shard.size}, total={n}, {dtype})"
            result = impl(comm, shard, n)
            aliased = alias_problem(result, shard, case, "the shard")
            if aliased:
                raise Mismatch(aliased)
            got = as_array(result, case)
            if got.dtype != full.dtype:
                raise Mismatch(f"{case}: returned dtype {got.dtype}, expected {full.dtype} (the shard's)")
            problem = compare(got, full, case, exact=True, chunks=p)
            if problem:
                raise Mismatch(problem + " (rank j's shard is chunk j: the result must be in rank order)")


def _traffic(comm, impl):
    p, n = comm.size, 1201
    shard = to_learner(np.array_split(np.ones(n, np.float32), p)[comm.rank])
    sent, messages = traffic(comm, lambda: impl(comm, shard, n))
    chunk = -(-n // p)
    bound = (p - 1) * chunk * 4
    if sent > bound or messages != p - 1:
        raise Mismatch(f"rank {comm.rank} of {p} sent {messages} message(s), {sent} bytes in all, for {n} float32 "
                       f"elements; a ring all-gather sends p-1 = {p - 1} messages of one chunk "
                       f"(ceil(N/p) = {chunk} elements), at most {bound} bytes")


def checks():
    return world_checks([("every rank gets the whole array: every length and dtype", _exact, 2, 1),
                         ("the ring's traffic: p-1 messages of one chunk", _traffic, 1, 2)])


def reference():
    from minitrain.comm import ring_all_gather
    return lambda comm, shard, total: ring_all_gather(comm, shard, total=total)

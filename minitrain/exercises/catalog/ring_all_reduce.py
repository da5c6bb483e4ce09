"""Grader: the library's collective checks (every length, dtype and op, bit for bit, p = 1..4),
the input left untouched, and the ring's traffic: 2(p-1) messages and at most 2(p-1)·ceil(N/p)
elements sent per rank (an exchange of whole arrays is exact but fails this)."""
import numpy as np

from minitrain.comm.checks import rank_input

from ..comparing import to_learner
from ..grading import Mismatch
from ..oracles import cases, check_reduction, traffic, world_checks

TITLE = "the ring all-reduce on point-to-point calls (reduce-scatter, then all-gather)"
ORDER = 70
KIND = "implement"
NOTEBOOK = "02_collectives"
DEFINES = "ring_all_reduce"

STUB = '''"""Exercise ring_all_reduce: the ring all-reduce (Patarasuk and Yuan 2009), the algorithm behind
DDP and NCCL.

Write ring_all_reduce(comm, x, op="sum") with only point-to-point calls:

    comm.rank, comm.size
    comm.sendrecv(sendbuf, dest, recvbuf, source)   send to dest and receive from source at once
    comm.send(buf, dest), comm.recv(buf, source)    buffers are contiguous NumPy arrays

Contract:
  - return a NEW array with x's shape and dtype holding the reduction of every rank's x;
    leave x untouched;
  - op is "sum", "mean", "max" or "min" ("mean" only for floating dtypes: sum, then divide by p);
  - any length works: 0, 1, fewer elements than ranks, lengths not divisible by the ranks;
  - it is a ring: split x into p chunks as np.array_split does, and let every rank send only to
    its right neighbour and receive only from its left one, one chunk per step, 2(p-1) steps.
    Each rank then sends 2(p-1)/p of the array, whatever p is: that is why the ring scales.

The test to pass: the library's collective checks at p = 1, 2, 3, 4 (every length above, five
dtypes, four ops, compared bit for bit with the NumPy reduction), then the traffic: 2(p-1)
messages and at most 2(p-1) chunks of ceil(N/p) elements sent per rank.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check ring_all_reduce mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check ring_all_reduce mine.py
Stuck?     python -m minitrain.exercises hint ring_all_reduce
"""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    raise NotImplementedError("ring_all_reduce: write the reduce-scatter phase, then the all-gather phase")
'''

HINTS = (
    "Two phases of p-1 steps each. Phase 1 (reduce-scatter): at every step each rank sends one "
    "chunk to its right neighbour (rank + 1) % p, receives one from its left neighbour (rank - 1) % p, "
    "and combines what it receives into its own copy of that chunk. After p-1 steps each rank holds "
    "one chunk fully reduced. Phase 2 (all-gather): p-1 more steps pass the finished chunks around "
    "the ring, copying instead of combining.",
    "Which chunk moves when? In phase 1 the chunk a rank sends at step s+1 is the one it just "
    "combined at step s, so a chunk travels once round the ring picking up every rank's share. Pick "
    "the indices so that rank r ends phase 1 with chunk r finished (then phase 2 must start by "
    "sending chunk r). Write the chunk bounds once: bounds = np.cumsum([0] + [len(c) for c in "
    "np.array_split(np.arange(n), p)]); chunk i is flat[bounds[i]:bounds[i + 1]] (maybe empty).",
    "Phase 1, step s = 0 .. p-2: rank r sends chunk (r - s - 1) % p and receives chunk (r - s - 2) % p, "
    "combining it (np.add / np.maximum / np.minimum with out=). Phase 2, step s: rank r sends chunk "
    "(r - s) % p and receives chunk (r - s - 1) % p into place. Work on a flat copy "
    "(np.ascontiguousarray(x).reshape(-1).copy()), receive into a fresh buffer of the incoming "
    "chunk's size, divide by p once at the end for op='mean', and reshape to x.shape.",
)


def _exact(comm, impl):
    for n, dtype, op in cases(comm.size):
        x = to_learner(rank_input(comm.rank, n, dtype))
        before = x.copy()
        check_reduction(comm, impl(comm, x, op=op), x, before, n, dtype, op, "ring_all_reduce")


def _traffic(comm, impl):
    p, n = comm.size, 1201
    x = to_learner(np.ones(n, np.float32))
    sent, messages = traffic(comm, lambda: impl(comm, x, op="sum"))
    chunk = -(-n // p)
    bound = 2 * (p - 1) * chunk * 4
    if sent > bound or (p > 1 and messages != 2 * (p - 1)):
        raise Mismatch(f"rank {comm.rank} of {p} sent {messages} message(s), {sent} bytes in all, for {n} float32 "
                       f"elements ({sent / (n * 4):.2f} arrays); the ring sends 2(p-1) = {2 * (p - 1)} messages "
                       f"of one chunk (ceil(N/p) = {chunk} elements), at most {bound} bytes: send one chunk per "
                       "step to the right neighbour, not whole arrays")


def checks():
    return world_checks([("exact on every length, dtype and op, input untouched", _exact, 2, 1),
                         ("the ring's traffic: 2(p-1) messages of one chunk", _traffic, 1, 2)])


def reference():
    from minitrain.comm import ring_all_reduce
    return ring_all_reduce

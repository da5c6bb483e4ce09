"""Grader: the library's all-reduce checks (every length, dtype and op, bit for bit, p = 1..4;
p = 3 is not a power of two) and the traffic: at most floor(log2 p) + 1 messages of the whole
vector per rank (the ring's 2(p-1) messages and the naive root's p-1 fail at p = 4)."""
import math

import numpy as np

from minitrain.comm.checks import rank_input

from ..comparing import to_learner
from ..grading import Mismatch
from ..oracles import cases, check_reduction, traffic, world_checks

TITLE = "recursive doubling: an all-reduce in log2(p) rounds, for small messages"
ORDER = 80
KIND = "implement"
NOTEBOOK = "02_collectives"
DEFINES = "recursive_doubling_all_reduce"

STUB = '''"""Exercise recursive_doubling: the all-reduce for small messages (Thakur et al. 2005).

The ring sends 2(p-1) messages: for a few bytes, the latency of each message dominates. Recursive
doubling needs only log2(p) rounds, each exchanging the whole vector with one partner.

Write recursive_doubling_all_reduce(comm, x, op="sum") with only point-to-point calls:

    comm.rank, comm.size
    comm.sendrecv(sendbuf, dest, recvbuf, source)   send to dest and receive from source at once
    comm.send(buf, dest), comm.recv(buf, source)    buffers are contiguous NumPy arrays

Contract:
  - return a NEW array with x's shape and dtype holding the reduction of every rank's x on
    every rank; leave x untouched; op is "sum", "mean", "max" or "min";
  - any number of ranks, powers of two or not (p = 3 is tested);
  - each rank sends at most floor(log2 p) + 1 messages, each the whole vector.

The test to pass: the library's all-reduce checks at p = 1, 2, 3, 4 (every length, five dtypes,
four ops, bit for bit), then the message count.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check recursive_doubling mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check recursive_doubling mine.py
Stuck?     python -m minitrain.exercises hint recursive_doubling
"""
import numpy as np


def recursive_doubling_all_reduce(comm, x, op="sum"):
    raise NotImplementedError("recursive_doubling_all_reduce: exchange whole vectors with partners")
'''

HINTS = (
    "Round k = 0, 1, ...: every rank exchanges its current vector with one partner and combines the "
    "two. Choose partners so that after round k each rank holds the reduction over a group of 2^(k+1) "
    "ranks, the group doubling every round: log2(p) rounds for p a power of two.",
    "In round k the partner is the rank whose number differs from yours in bit k only: r ^ (1 << k). "
    "Both partners combine the same two vectors, so they end with the same result (a + b == b + a in "
    "floating point). Use comm.sendrecv with the partner as both dest and source.",
    "p not a power of two: let q be the largest power of two <= p and e = p - q. First, ranks r >= q "
    "send their vector to r - q and later receive the final result from it (that is all they do); "
    "ranks r < e receive from r + q and combine. Then ranks 0 .. q-1 run the rounds. At the end ranks "
    "r < e send the result to r + q. For 'mean' divide by p once, before that last send.",
)


def _exact(comm, impl):
    for n, dtype, op in cases(comm.size):
        x = to_learner(rank_input(comm.rank, n, dtype))
        before = x.copy()
        check_reduction(comm, impl(comm, x, op=op), x, before, n, dtype, op, "recursive_doubling_all_reduce")


def _traffic(comm, impl):
    p, n = comm.size, 301
    x = to_learner(np.ones(n, np.float64))
    sent, messages = traffic(comm, lambda: impl(comm, x, op="sum"))
    most = int(math.log2(p)) + 1
    if messages > most or sent > messages * n * 8:
        raise Mismatch(f"rank {comm.rank} of {p} sent {messages} message(s), {sent} bytes; recursive doubling "
                       f"sends at most floor(log2 p) + 1 = {most} messages of the whole vector ({n * 8} bytes). "
                       "A ring sends 2(p-1) small messages and a root-based all-reduce p-1 from the root")


def checks():
    return world_checks([("exact on every length, dtype and op, input untouched", _exact, 2, 1),
                         ("log2(p) rounds: at most floor(log2 p) + 1 messages per rank", _traffic, 1, 2)])


def reference():
    from minitrain.comm import recursive_doubling_all_reduce
    return recursive_doubling_all_reduce

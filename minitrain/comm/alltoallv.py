"""all_to_all_single with uneven splits (PyTorch's call; MPI_Alltoallv; Thakur et al. 2005's
pairwise exchange), hand-written on point-to-point.

Rows of x (axis 0) are cut into p blocks by input_split_sizes; block j goes to rank j, and
the result stacks, in rank order, the blocks every rank sent here (output_split_sizes[i] rows
from rank i). Round k = 1..p-1: rank r sends its block for (r+k)%p and receives the one from
(r-k)%p, so every round is a perfect matching and nobody waits on a busy peer. Per rank: p-1
messages, (rows sent to other ranks)·row bytes counted (the own block is a local copy).

Sizes: PyTorch requires output_split_sizes whenever the input is uneven; here None means the
ranks first exchange their counts (p-1 tiny messages, counted apart under "all_to_all_single
sizes"), and every rank must then pass None. Under check_collectives every rank's send and receive
counts are gathered (p-1 tiny messages, counted under "check_collectives") and compared before any
row moves: a disagreement raises CollectiveMismatchError on every rank, naming both ranks and both
sizes, where the bare exchange would fail on one rank only (a receive of the wrong size).
"""
import operator

import numpy as np

from ..backend import array_module
from .errors import CollectiveMismatchError

NAME = "all_to_all_single"


def _splits(comm, sizes, what, total=None):
    """``sizes`` as a list of p non-negative ints (summing to ``total`` if given); one error line otherwise."""
    p = comm.size
    try:
        sizes = [operator.index(s) for s in sizes]
    except (TypeError, ValueError):
        raise ValueError(f"[rank {comm.rank}] {NAME}: {what} must be {p} integers, got {sizes!r}") from None
    if len(sizes) != p or any(s < 0 for s in sizes) or (total is not None and sum(sizes) != total):
        need = f", summing to the {total} rows of x" if total is not None else ""
        raise ValueError(f"[rank {comm.rank}] {NAME}: {what} must be {p} non-negative integers{need}, "
                         f"got {sizes}")
    return sizes


def _exchange(comm, tag, row, counted):
    """A ring all-gather of one int64 row per rank (p-1 steps), counted only under ``counted``."""
    p, r = comm.size, comm.rank
    table = np.zeros((p, len(row)), np.int64)
    table[r] = row
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        reqs = [comm._post(table[recv_i], (r - 1) % p, tag, "recv", counted=counted),
                comm._post(table[send_i], (r + 1) % p, tag, "send", counted=counted)]
        comm.wait_all(reqs, f"{NAME} sizes")
    return table


def _check_counts(comm, sends, expected):
    """sends[i][j]: rows rank i sends to j; expected[j][i]: rows j expects from i (-1: any)."""
    wrong = [(i, j) for i in range(comm.size) for j in range(comm.size)
             if expected[j][i] >= 0 and expected[j][i] != sends[i][j]]
    if wrong:
        lines = [f"  rank {i} sends {sends[i][j]} rows to rank {j}, which expects {expected[j][i]} from rank {i}"
                 for i, j in wrong]
        raise CollectiveMismatchError(f"[rank {comm.rank}] {NAME}: the split sizes disagree between ranks "
                                      f"(check_collectives):\n" + "\n".join(lines))


def _body(comm, tag, x, sends, receives):
    p, r = comm.size, comm.rank
    if getattr(comm, "check_collectives", False) and p > 1:
        table = _exchange(comm, tag, sends + (receives or [-1] * p), "check_collectives")
        _check_counts(comm, table[:, :p].tolist(), table[:, p:].tolist())
        receives = receives or table[:, r].tolist()
    elif receives is None:
        receives = _exchange(comm, tag, sends, f"{NAME} sizes")[:, r].tolist()
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    out = xp.empty((sum(receives),) + x.shape[1:], x.dtype)
    send_at, recv_at = np.cumsum([0] + sends), np.cumsum([0] + receives)

    def block(a, at, j):
        return a[at[j]:at[j + 1]]
    block(out, recv_at, r)[...] = block(x, send_at, r)
    for k in range(1, p):                    # pairwise exchange: send to r+k, hear from r-k
        dest, source = (r + k) % p, (r - k) % p
        comm.sendrecv(block(x, send_at, dest), dest, block(out, recv_at, source), source, tag)
    return out


def all_to_all_single(comm, x, output_split_sizes=None, input_split_sizes=None, async_op=False):
    """Rows of ``x`` split by ``input_split_sizes`` (p equal blocks when None) go to ranks 0..p-1;
    returns the rows received, ``output_split_sizes[i]`` from rank i (None: exchanged first when
    the input is uneven, else equal blocks), stacked in rank order (a Work when async)."""
    p = comm.size
    if getattr(x, "ndim", 0) == 0:
        raise ValueError(f"[rank {comm.rank}] {NAME}: x must have a first axis of rows, got {type(x).__name__} "
                         f"of shape {getattr(x, 'shape', None)}")
    n = x.shape[0]
    if input_split_sizes is None and n % p:
        raise ValueError(f"[rank {comm.rank}] {NAME}: {n} rows do not divide into {p} equal blocks; "
                         f"pass input_split_sizes")
    sends = [n // p] * p if input_split_sizes is None else _splits(comm, input_split_sizes, "input_split_sizes", n)
    if output_split_sizes is None and input_split_sizes is None:
        output_split_sizes = [n // p] * p        # equal blocks everywhere (PyTorch's default)
    receives = None if output_split_sizes is None else _splits(comm, output_split_sizes, "output_split_sizes")
    # the header (check_collectives, flight records) holds the row shape, which every rank's must match,
    # and whether the counts are exchanged (all ranks or none: sizes_exchanged=1 or 0)
    header = {"shape": x.shape[1:], "dtype": x.dtype, "extra": int(receives is None)}
    return comm.launch(NAME, _body, (x, sends, receives), async_op, header, x.nbytes)

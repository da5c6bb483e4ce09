"""torch.distributed's monitored_barrier: a barrier that names the ranks that did not arrive in time.

As gloo's (ProcessGroupGloo::monitoredBarrier): each rank tells rank 0 of the group it has arrived; rank 0
waits up to the timeout, sends every rank its verdict and raises naming the first late rank (wait_all_ranks:
all). A rank on time passes or raises naming the late ones; a late rank finds its verdict and raises at once.
Unlike gloo's, the others wait for rank 0 at most the timeout plus the group's, then name it (a rank 0 later
still passes alone). A receive given up on stays posted for its late message: under MPICH a message never
received ends the job with a SIGKILL at exit. Cost: 2 (p - 1) small messages through rank 0; no wait spins.
"""
import atexit
import time

import numpy as np

from ..comm.communicator import MAX_SLEEP_S
from ..comm.errors import CollectiveTimeout
from .groups import _group, seconds

POLL = (0.0, MAX_SLEEP_S)        # wait_all's poll: no sched_yield window, sleep from the start
_unanswered = []                 # requests of a late message, kept (with their buffers) until they complete


@atexit.register
def _settle():
    """Complete the late messages that have come by exit: a request never completed keeps its communicator
    referenced, and MPICH's MPI_Finalize warns of it."""
    for request in _unanswered:
        try:
            request.test()
        except Exception:          # leaving anyway: a late message that failed is nothing to report now
            pass


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """A barrier whose rank 0 raises naming the ranks that do not arrive within ``timeout`` (a timedelta or
    seconds; None: the group's timeout); the others raise too, naming them (see the module docstring)."""
    pg = _group(group, "monitored_barrier")
    if pg is None:
        return None
    limit = pg.comm.timeout if timeout is None else seconds(timeout)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"monitored_barrier: timeout must be a positive timedelta or number of seconds, got "
                         f"{timeout!r}")
    comm = pg.comm
    arrive, release = comm.next_tag("monitored_barrier")[1], comm.next_tag("monitored_barrier")[1]
    _unanswered[:] = [request for request in _unanswered if not request.test()]
    if comm.size > 1:
        (_collect if comm.rank == 0 else _arrive)(pg, limit, wait_all_ranks, arrive, release)


def _ranks(pg, ranks):
    """'Rank 1' / 'Ranks 1, 2' as PyTorch's message names group ranks; the global ones beside, in a subgroup."""
    text = ("Rank " if len(ranks) == 1 else "Ranks ") + ", ".join(map(str, ranks))
    if pg.ranks != list(range(len(pg.ranks))):
        text += f" (global {', '.join(str(pg.ranks[q]) for q in ranks)})"
    return text


def _late(comm, request, what, seconds):
    """Wait up to ``seconds`` for ``request``; True (and the request kept posted) if it has not come."""
    try:
        comm.wait_all([request], what, POLL, max(seconds, 0.0), withdraw=False)
        return False
    except CollectiveTimeout:
        _unanswered.append(request)
        return True


def _collect(pg, limit, wait_all_ranks, arrive, release):
    """Rank 0: every other rank's arrival until the deadline (past it, each wait is one test), then the
    verdict to each."""
    comm = pg.comm
    arrivals = {q: comm.post_unrecorded(np.empty(1, np.int64), q, arrive, "recv") for q in range(1, comm.size)}
    deadline = time.monotonic() + limit
    late = [q for q, request in arrivals.items()
            if _late(comm, request, f"monitored_barrier (rank {q}'s arrival)", deadline - time.monotonic())]
    verdict = np.zeros(comm.size, np.int64)
    verdict[late] = 1
    sends = {q: comm.post_unrecorded(verdict, q, release, "send") for q in arrivals}
    comm.wait_all([sends[q] for q in arrivals if q not in late], "monitored_barrier (the verdicts)")
    _unanswered.extend(sends[q] for q in late)
    if late:
        raise CollectiveTimeout(f"[Rank 0]: {_ranks(pg, late if wait_all_ranks else late[:1])} failed to pass "
                                f"monitoredBarrier in {round(limit * 1000)} ms")


def _arrive(pg, limit, wait_all_ranks, arrive, release):
    """Any other rank: say so to rank 0, then wait for its verdict."""
    comm, me = pg.comm, pg.comm.rank
    verdict = np.empty(comm.size, np.int64)
    answer = comm.post_unrecorded(verdict, 0, release, "recv")
    sent = comm.post_unrecorded(np.array([me], np.int64), 0, arrive, "send")
    bound = limit + comm.timeout
    if _late(comm, answer, "monitored_barrier (rank 0's verdict)", bound):
        _unanswered.append(sent)
        raise CollectiveTimeout(f"[Rank {me}]: rank 0 did not answer monitored_barrier within {bound:g} s (the "
                                f"timeout plus the group's): it collects every rank's arrival, and has not called "
                                f"monitored_barrier or is gone")
    late = np.flatnonzero(verdict).tolist()
    if me in late:
        _unanswered.append(sent)          # rank 0's receive, kept posted, takes it
        raise CollectiveTimeout(f"[Rank {me}]: {_ranks(pg, [me])} failed to pass monitoredBarrier in "
                                f"{round(limit * 1000)} ms: rank 0 had stopped waiting when it arrived")
    comm.wait_all([sent], "monitored_barrier (the arrival)")     # rank 0 has it: done at once
    if late:
        raise CollectiveTimeout(f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but rank 0 found "
                                f"that {_ranks(pg, late)} failed to pass monitoredBarrier in {round(limit * 1000)} ms")

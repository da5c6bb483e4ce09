"""What a rank says when a wait stalls or a message does not fit (the guard's reports, guard.py).

stalled: a wait past comm_timeout collects every rank's flight records (out of band) and
analyzes them: a fatal verdict (another call, a rank gone, a deadlock) raises now, a slow rank is
named in one warning (by the lowest waiting rank: every rank computes the same reporter from the same
records) and the wait goes on; past the hard timeout it raises whatever the verdict.
sender_note: what the receive contract's error (errors.size_error) adds: the sender's call, from its
flight record. raise_once: one rank reports a fault, the others give it time to end the job first.
"""
import sys

from .errors import CollectiveMismatchError, CollectiveTimeout
from .flight_text import call_name, format_report, signature
from .flight_verdict import analyze

SNAPSHOT_TIMEOUT_S = 3.0          # how long a stalled rank waits for the others' flight records


def range_all(comm):
    """Every world rank this communicator's process can see (the members, at least)."""
    world = getattr(comm, "world_size", None)
    return list(range(world)) if world else list(comm.members)


def raise_once(comm, error, reporter):
    """One rank reports a fault; the others give it time to end the job (or to raise, on
    ThreadWorld) before they raise too, so a user reads one report, not p of them."""
    if reporter != comm.world_rank:
        comm._wait_for_reporter(reporter, comm.comm_timeout + 2.0)
    raise error


def _stall_call(comm, pending):
    """(record, members) of what this wait is part of: the collective, or the first p2p call."""
    call = comm._call()
    if call is not None:
        return call, comm.members
    for r in pending:
        if r.record is not None:
            return r.record, sorted({comm.world_rank, r.record.peer})
    return None, None


def stalled(comm, pending, what, elapsed, hard):
    """Compare flight records; raise now on a mismatch (or at the hard timeout), warn otherwise."""
    call, members = _stall_call(comm, pending)
    if call is None:            # (past the hard timeout, the core raises CollectiveTimeout)
        return
    snaps = comm._snapshots(range_all(comm), SNAPSHOT_TIMEOUT_S)
    snaps[comm.world_rank] = comm.recorder.snapshot()
    record = call.as_dict()
    verdict = analyze(comm.world_rank, record, members, snaps)
    report = format_report(comm.world_rank, record, members, snaps, verdict, elapsed,
                           None if (hard or verdict.fatal) else comm.timeout)
    who = reporter(record["comm"], members, snaps, comm.world_rank)
    if not (hard or verdict.fatal):
        if who == comm.world_rank:
            sys.stderr.write(prefixed(comm.world_rank, "warning: " + report) + "\n")
            sys.stderr.flush()
        return
    error = (CollectiveTimeout if hard and not verdict.fatal else CollectiveMismatchError)(
        f"[rank {comm.rank}] {report}")
    raise_once(comm, error, who)


def sender_note(comm, request, call):
    """The sender's side of a receive that does not fit: what it called (or sent), if it answers."""
    peer = request.peer
    sender = _peer_call(comm, comm.members[peer], call, request.tag)
    if sender is None:
        return ""
    if call is not None:
        return (f"; rank {peer} called {call_name(sender)} with {signature(sender)}, rank {comm.rank} "
                f"with {signature(call.as_dict())}")
    return f"; rank {peer} sent {sender['dtype']} of shape {tuple(sender['shape'])} ({sender['nbytes']} bytes)"


def _peer_call(comm, peer_world, call, tag):
    """The peer's record of the same collective (or its send with this tag), if it answers."""
    try:
        snap = comm._snapshots([peer_world], SNAPSHOT_TIMEOUT_S).get(peer_world)
    except Exception:          # an error path: the report is a bonus
        return None
    if not snap:
        return None
    for r in reversed(snap["records"]):
        if call is not None and r["comm"] == call.comm and r["seq"] == call.seq:
            return r
        if call is None and r["seq"] < 0 and r["name"] == "send" and r["tag"] == tag and r["peer"] == comm.world_rank:
            return r
    return None


def reporter(comm, members, snaps, me):
    """The lowest rank waiting in any call on ``comm`` reports a fault (every rank computes the
    same answer from the same records); ``me`` if no record says so."""
    waiting = [m for m in members if snaps.get(m) and any(
        r["comm"] == comm and r["state"] == "running" for r in snaps[m]["records"])]
    return min(waiting) if waiting else me


def prefixed(rank, text):
    return "\n".join(f"[rank {rank}] {line}" for line in text.splitlines())

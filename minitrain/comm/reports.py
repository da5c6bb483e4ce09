"""What a rank says when a wait stalls or a message does not fit.

stalled: a wait past comm_timeout collects every rank's flight records (out of band) and
analyzes them: a fatal verdict (another call, a rank gone, a deadlock) raises now, a slow rank is
named in one warning (by the lowest waiting rank: every rank computes the same reporter from the same
records) and the wait goes on; past the hard timeout it raises whatever the verdict.
size_error: the receive contract, one text for both transports: both ranks, the call (collective
and sequence number, or the p2p tag), both sizes, and the sender's call from its flight record.
"""
import sys

from .communicator import (SNAPSHOT_TIMEOUT_S, CollectiveMismatchError, CollectiveTimeout, CommError,
                           range_all)
from .flight_recorder import analyze, call_name, format_report, signature


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
    if call is None:
        if hard:
            peers = sorted({r.peer for r in pending})
            raise CollectiveTimeout(f"[rank {comm.rank}] {what} timed out after {comm.timeout:g} s; no answer "
                                    f"from rank(s) {peers}")
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
    comm._raise_once(error, who)


def size_error(comm, request, received, their_dtype=None):
    """A receive whose size (or dtype) is not the sender's: name both ranks, the call, both sizes."""
    buf, peer = request.buf, request.peer
    call = comm._call()
    where = call_name(call.as_dict()) + ("" if comm.uid == "world" else f" on {comm.uid}") if call else \
        f"recv from rank {peer} (tag {request.tag})"
    theirs = (f"{received} bytes" if received is not None else f"more than the {buf.nbytes} bytes that fit")
    if their_dtype is not None:
        theirs += f" of {their_dtype}"
    text = (f"[rank {comm.rank}] {where}: the message from rank {peer} has {theirs}, but rank {comm.rank} "
            f"expected {buf.nbytes} bytes ({buf.dtype.name}, shape {tuple(buf.shape)})")
    sender = _peer_call(comm, comm.members[peer], call, request.tag)
    if sender is not None:
        mine = call.as_dict() if call else None
        if call is not None:
            text += (f"; rank {peer} called {call_name(sender)} with {signature(sender)}, rank {comm.rank} "
                     f"with {signature(mine)}")
        else:
            text += f"; rank {peer} sent {sender['dtype']} of shape {tuple(sender['shape'])} ({sender['nbytes']} bytes)"
    return (CollectiveMismatchError if call is not None else CommError)(text)


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

"""The flight recorder's verdict: what a stalled wait makes of every rank's records (flight_recorder.py).

analyze names it: a rank at another call or sequence number, or one that has left, ends the job at
once; a rank still computing is named in a warning and the wait goes on to the hard timeout; ranks
each waiting for the next are a deadlock (with its cause where the records show one: a message of
another dtype, size or tag). How the records and the report read: flight_text.py. Everything here reads
snapshots (plain dicts): no rank's live state.
"""
from collections import Counter

from .flight_text import call_name, fmt_bytes, signature


class Verdict:
    """``kind``: mismatch | finished | deadlock (end the job now) or slow | arrived | unknown
    (warn, wait to the hard timeout); ``culprits``: the ranks to blame; ``text``: one sentence."""

    FATAL = ("mismatch", "finished", "deadlock")

    def __init__(self, kind, culprits, text):
        self.kind, self.culprits, self.text = kind, sorted(culprits), text

    @property
    def fatal(self):
        return self.kind in self.FATAL


def record_at(snap, comm, seq):
    """The record of collective #seq on ``comm`` in a snapshot, or None."""
    for r in reversed(snap["records"]):
        if r["comm"] == comm and r["seq"] == seq:
            return r
    return None


def analyze(asker, call, members, snapshots):
    """``asker``: the waiting rank (world); ``call``: its stalled record (dict); ``members``: world
    ranks of its communicator (a p2p call: the two ranks); ``snapshots``: world rank -> snapshot or None."""
    comm = call["comm"]
    if call["seq"] < 0:
        return _analyze_p2p(asker, call, snapshots)
    at_seq, behind, gone, silent = {}, [], [], []
    for m in members:
        snap = snapshots.get(m)
        if snap is None:
            silent.append(m)
            continue
        if snap["status"] in ("finished", "aborting", "failed"):
            gone.append(m)
            continue
        r = record_at(snap, comm, call["seq"])
        if r is not None:
            at_seq[m] = r
        elif snap["next_seq"].get(comm, 0) > call["seq"]:
            at_seq[m] = None                      # past this call, its record pushed out of the ring
        else:
            behind.append(m)
    where = f"{call['name']} #{call['seq']}" + ("" if comm == "world" else f" on {comm}")
    if gone:
        what = {m: snapshots[m]["status"] for m in gone}
        left = [m for m in gone if what[m] == "finished"]
        return Verdict("finished", gone, f"rank(s) {gone} {'have left the script' if left else 'have failed'} and "
                       f"will never call {where}, which rank(s) {sorted(set(members) - set(gone))} wait in")
    verdict = group_calls(comm, call["seq"], at_seq)
    if verdict is not None:
        return verdict
    cycle = _wait_cycle(call, snapshots)
    if cycle:
        return _deadlock(cycle, snapshots)
    if behind or silent:
        ends = _chain_ends(behind, snapshots)
        text = (f"rank(s) {behind} have not reached {where}" if behind else "")
        if ends and ends != behind:
            text += f" (they wait, in turn, for rank(s) {ends})"
        if silent:
            text += ("; " if text else "") + f"rank(s) {silent} did not answer"
        return Verdict("slow", sorted(set(ends or behind) | set(silent)), text)
    return Verdict("arrived", [], f"every rank is in {where} with the same arguments: the transfer itself is slow or stuck")


def group_calls(comm, seq, at_seq):
    """``at_seq``: world rank -> its record of collective #seq (None: it is past it). A Verdict
    naming the ranks in the minority when they differ (both sides when tied), else None."""
    groups = {}
    for m, r in at_seq.items():
        key = None if r is None else (r["name"], r["shape"], r["dtype"], r["op"], r["extra"])
        groups.setdefault(key, []).append(m)
    if len(groups) < 2:
        return None
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    tied = sizes[0] == sizes[1]
    majority = max(groups.values(), key=lambda g: (len(g), -min(g)))
    culprits = [m for g in groups.values() if tied or g is not majority for m in g]
    parts = []
    for ranks in sorted(groups.values()):
        r = at_seq[ranks[0]]
        parts.append(f"rank(s) {sorted(ranks)} called " + (f"{r['name']} #{seq} {signature(r)}" if r else f"past #{seq}"))
    return Verdict("mismatch", culprits, f"collective #{seq} on {comm} differs across ranks: " + "; ".join(parts))


def _waits(snap):
    """World ranks this rank waits for, with the calls it waits in."""
    out = []
    if snap is None:
        return out
    for r in snap["records"]:
        if r["state"] == "running" and r["waiting_for"]:
            out.append((r, list(r["waiting_for"])))
    return out


def _wait_cycle(call, snapshots):
    """A cycle of ranks each waiting for the next, through at least two different calls."""
    start = next((m for m, s in snapshots.items() if s is not None and any(r["comm"] == call["comm"] and r["seq"] == call["seq"]
                                                                         for r, _ in _waits(s))), None)
    if start is None:
        return None
    path, calls, seen = [start], [], {start}
    node = start
    while True:
        waits = _waits(snapshots.get(node))
        if not waits:
            return None
        record, peers = waits[0]
        calls.append(record)
        nxt = peers[0]
        if record["seq"] >= 0 and _has_finished(snapshots.get(nxt), record):
            return None           # nxt has sent its part of this collective: the wait is only late, not a cycle
        if nxt in seen:
            loop = path[path.index(nxt):]
            loop_calls = calls[path.index(nxt):]
            kinds = {(r["comm"], r["seq"], r["name"], r["tag"]) for r in loop_calls}
            return sorted(loop) if len(kinds) > 1 else None
        if nxt not in snapshots:
            return None
        path.append(nxt)
        seen.add(nxt)
        node = nxt


def _has_finished(snap, call):
    """Whether the rank of ``snap`` has finished collective ``call`` (its record done, or pushed out of the ring)."""
    if snap is None:
        return False
    r = record_at(snap, call["comm"], call["seq"])
    return r["state"] == "done" if r is not None else snap["next_seq"].get(call["comm"], 0) > call["seq"]


def _deadlock(cycle, snapshots):
    """A wait cycle; if one of its receives waits for a message its peer sent with another dtype or
    size (the tags keep them apart: neither ever completes), that is the cause to name."""
    for m in cycle:
        for r, _ in _waits(snapshots.get(m)):
            if r["seq"] < 0 and r["name"] == "recv":
                verdict = _p2p_mismatch(m, r, snapshots.get(r["peer"]))
                if verdict is not None:
                    return verdict
    return Verdict("deadlock", cycle, f"rank(s) {cycle} wait for each other in different calls (a deadlock)"
                   + _stray_tags(cycle, snapshots))


def _stray_tags(cycle, snapshots):
    """Where a receive in the cycle waits for one tag while its peer's sends to it with another were never
    received (a tag that differs between the two sides): that, as the cause, else ""."""
    for m in cycle:
        for r, _ in _waits(snapshots.get(m)):
            peer = snapshots.get(r["peer"])
            if r["seq"] >= 0 or r["name"] != "recv" or peer is None:
                continue
            sent = Counter(x["tag"] for x in peer["records"] if x["seq"] < 0 and x["name"] == "send" and x["peer"] == m)
            got = Counter(x["tag"] for x in snapshots[m]["records"]
                          if x["seq"] < 0 and x["name"] == "recv" and x["peer"] == r["peer"] and x["state"] == "done")
            stray = sorted(t for t in sent if t != r["tag"] and sent[t] > got[t])
            if stray:
                return (f": rank {m} waits to receive tag {r['tag']} from rank {r['peer']}, whose send(s) to it "
                        f"with tag {', '.join(map(str, stray))} were never received (the tags differ)")
    return ""


def _chain_ends(ranks, snapshots):
    """Follow who waits for whom from ``ranks``; return the ranks at the ends (computing / silent)."""
    ends, frontier, seen = set(), list(ranks), set(ranks)
    while frontier:
        m = frontier.pop()
        waits = _waits(snapshots.get(m))
        if not waits:
            ends.add(m)
            continue
        for _, peers in waits:
            for q in peers:
                if q not in seen and q in snapshots:
                    seen.add(q)
                    frontier.append(q)
    return sorted(ends)


def _analyze_p2p(me_rank, call, snapshots):
    peer = call["peer"]
    snap = snapshots.get(peer)
    if snap is None:
        return Verdict("slow", [peer], f"rank {peer} did not answer")
    if snap["status"] in ("finished", "aborting", "failed"):
        return Verdict("finished", [peer], f"rank {peer} has {'left the script' if snap['status'] == 'finished' else 'failed'}"
                       f" and will never answer {call_name(call)}")
    want = "recv" if call["name"] == "send" else "send"
    verdict = _p2p_mismatch(me_rank, call, snap)
    if verdict is not None:
        return verdict
    for r in reversed(snap["records"]):
        if r["seq"] < 0 and r["name"] == want and r["tag"] == call["tag"] and r["peer"] == me_rank:
            if r["state"] == "running":
                return Verdict("arrived", [], f"rank {peer} has posted the matching {want}: the transfer is slow")
    cycle = _wait_cycle(call, snapshots)
    if cycle:
        return _deadlock(cycle, snapshots)
    ends = _chain_ends([peer], snapshots)
    return Verdict("slow", ends, f"rank {peer} has not posted the matching {want}" +
                   (f" (it waits, in turn, for rank(s) {ends})" if ends != [peer] else ""))


def _p2p_mismatch(me_rank, call, peer_snap):
    """A Verdict if the peer's latest matching call (its send for our recv, or the reverse) with
    this tag has another dtype or size, else None."""
    if peer_snap is None:
        return None
    want = "recv" if call["name"] == "send" else "send"
    for r in reversed(peer_snap["records"]):
        if r["seq"] < 0 and r["name"] == want and r["tag"] == call["tag"] and r["peer"] == me_rank:
            if r["dtype"] == call["dtype"] and r["nbytes"] == call["nbytes"]:
                return None
            return Verdict("mismatch", [call["peer"], me_rank],
                           f"rank {me_rank} {call['name']}s {call['dtype']} {fmt_bytes(call['nbytes'])} ({call['nbytes']} "
                           f"bytes) with tag {call['tag']}, rank {call['peer']} {want}s {r['dtype']} "
                           f"{fmt_bytes(r['nbytes'])} ({r['nbytes']} bytes) with that tag")
    return None

"""How a flight record reads: a call's name and signature, what one rank is doing, and the *flight recorder
report* a user sees when a wait stalls (the records: flight_recorder.py; the verdict: flight_verdict.py).
Everything here reads snapshots (plain dicts): no rank's live state.
"""


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def call_name(r):
    if r["seq"] >= 0:
        return f"{r['name']} #{r['seq']}"
    return f"{r['name']} {'to' if r['name'] == 'send' else 'from'} rank {r['peer']} (tag {r['tag']})"


def signature(r):
    parts = []
    if r["shape"] is not None:
        parts.append(f"shape={tuple(r['shape'])}")
    if r["dtype"] is not None:
        parts.append(str(r["dtype"]))
    if r["nbytes"] is not None:
        parts.append(fmt_bytes(r["nbytes"]))
    if r["op"] is not None:
        parts.append(f"op={r['op']}")
    if r["extra"] is not None:
        label = {"broadcast": "root", "reduce": "root", "naive_all_reduce": "root",
                 "all_to_all_single": "sizes_exchanged"}
        parts.append(f"{label.get(r['name'], 'total')}={r['extra']}")
    return " ".join(parts)


def describe_record(r, now):
    where = f"{call_name(r)} on {r['comm']}" if r["comm"] != "world" else call_name(r)
    if r["state"] in ("done", "failed"):
        return f"{where} {signature(r)}: {r['state']} {now - r['end']:.2f} s ago (took {r['end'] - r['start']:.3f} s)"
    if r["state"] == "queued":
        return f"{where} {signature(r)}: queued {now - r['start']:.2f} s ago (asynchronous, not started)"
    text = f"{where} {signature(r)}: running for {now - r['start']:.2f} s"
    if r["waiting_for"]:
        text += f", waiting {now - r['wait_since']:.2f} s for rank(s) {list(r['waiting_for'])}"
    return text


def describe_rank(snap, comm):
    """What one rank is doing, in one line."""
    if snap is None:
        return "no answer from its flight recorder (dead, or stuck outside Python holding the GIL)"
    now = snap["now"]
    active = [r for r in snap["records"] if r["state"] in ("running", "queued")]
    if snap["status"] == "finished":
        last = [r for r in snap["records"] if r["comm"] == comm]
        return (f"has left the script{' (' + snap['detail'] + ')' if snap['detail'] else ''}; "
                f"last call on {comm}: {call_name(last[-1]) if last else 'none'}")
    if snap["status"] in ("aborting", "failed"):
        return f"has failed: {snap['detail']}"
    if active:
        return "in " + "; and in ".join(describe_record(r, now) for r in active)
    done = [r for r in snap["records"] if r["end"] is not None]
    if not done:
        return "computing (no call recorded yet)"
    last = max(done, key=lambda r: r["end"])
    return f"computing: no call in progress; its last call, {call_name(last)} on {last['comm']}, ended {now - last['end']:.2f} s ago"


def format_report(asker, call, members, snapshots, verdict, waited, hard_timeout=None):
    """The flight recorder report: who waits where, what every rank is doing, and the verdict."""
    head = (f"flight recorder report (rank {asker}): {call_name(call)}"
            + (f" on {call['comm']}" if call["comm"] != "world" else "") + f" has waited {waited:.1f} s")
    lines = [head]
    for m in sorted(set(members) | set(verdict.culprits)):
        mark = "   <-- " + ("differs" if verdict.kind == "mismatch" else "here") if m in verdict.culprits else ""
        lines.append(f"  rank {m}: {describe_rank(snapshots.get(m), call['comm'])}{mark}")
    if verdict.fatal:
        lines.append(f"verdict: {verdict.text}. Ending the job.")
    elif hard_timeout is None:
        lines.append(f"verdict: {verdict.text}. Ending the job (hard timeout).")
    else:
        lines.append(f"verdict: {verdict.text}. Still waiting, up to the hard timeout ({hard_timeout:g} s).")
    culprit_history = [m for m in verdict.culprits if snapshots.get(m)]
    for m in culprit_history[:2]:
        recent = [r for r in snapshots[m]["records"] if r["comm"] == call["comm"]][-4:]
        if recent:
            lines.append(f"  rank {m}'s last calls on {call['comm']}: " + ", ".join(
                f"{call_name(r)} {r['state']}" for r in recent))
    return "\n".join(lines)

"""check_collectives: before a collective moves a byte, each rank compares its *header* (name,
sequence number, shape, dtype, op, root/total) with its ring neighbour's: one small message each
way, p messages in all (measured: an all-to-all of headers cost 3x as much at p = 4; sending the
header beside the data instead of before it saved nothing measurable, the cost being the calls'
own overhead, and would let a rank whose neighbour agrees return a result mixed from different
calls). If any two ranks disagree, some pair of neighbours does: the ranks that see it send no data
(so no result that depends on theirs completes); each reads every rank's flight record of this
call (flight_recorder.py) and raises CollectiveMismatchError naming each rank's call, with
<-- differs at the minority. Headers are fixed-size int64 arrays, compared element by element;
names, dtypes and ops travel as CRC-32 codes (register_names: every rank can decode a name it
never called). Counted apart from the data, in comm.stats["check_collectives"]. Part of the guard (guard.py).
"""
import time
import zlib

import numpy as np

from .collectives import COLLECTIVE_NAMES
from .communicator import COLLECTIVE_TAG_SPAN, NAME_TAG_SLOTS, USER_TAG_LIMIT
from .wire import DTYPE_NAMES
from .errors import CollectiveMismatchError
from .flight_text import call_name, signature
from .flight_verdict import group_calls, record_at
from .reports import SNAPSHOT_TIMEOUT_S, raise_once, range_all


def header_tag(seq):
    """The last name slot, which no collective's tag uses: collective #seq's headers meet whatever
    collective each rank called."""
    return USER_TAG_LIMIT + (seq % COLLECTIVE_TAG_SPAN) * NAME_TAG_SLOTS + NAME_TAG_SLOTS - 1


def check_header(comm, record):
    """Send this call's header right, receive the left neighbour's, compare; raise if they differ."""
    mine = encode_header(record)
    theirs = np.empty_like(mine)
    tag = header_tag(record.seq)
    # posted as the pipeline posts (its own contiguous int64 arrays, neighbours in range): counted here, apart
    comm.stats.record("check_collectives", mine.nbytes, "received", total=False)
    comm.stats.record("check_collectives", mine.nbytes, "sent", total=False)
    reqs = [comm.post_unrecorded(theirs, (comm.rank - 1) % comm.size, tag, "recv"),
            comm.post_unrecorded(mine, (comm.rank + 1) % comm.size, tag, "send")]
    comm.wait_all(reqs, "header check")
    if theirs.tobytes() != mine.tobytes():          # (np.array_equal: 10x slower on 15 numbers)
        _report(comm, record, theirs)


def _report(comm, record, theirs):
    """The left neighbour's header differs: read every rank's record of this call and raise (the
    lowest rank that saw a difference reports)."""
    left = (comm.rank - 1) % comm.size
    deadline = time.monotonic() + min(comm.comm_timeout, 2.0)
    while True:             # the other ranks' records of this call (some may be a moment behind)
        snaps = comm._snapshots(range_all(comm), SNAPSHOT_TIMEOUT_S)
        snaps[comm.world_rank] = comm.recorder.snapshot()
        calls = {w: record_at(snaps[w], record.comm, record.seq) if snaps.get(w) else None for w in comm.members}
        if all(calls.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if calls[comm.members[left]] is None:
        calls[comm.members[left]] = decode_header(theirs, record.comm)
    verdict = group_calls(record.comm, record.seq, {w: c for w, c in calls.items() if c is not None})
    lines = [f"[rank {comm.rank}] flight recorder report (check_collectives): {verdict.text}"]
    for w in comm.members:
        c = calls[w]
        what = f"{call_name(c)} {signature(c)}" if c else "not at this call (yet), or no answer from its flight recorder"
        lines.append(f"  rank {w}: {what}" + ("   <-- differs" if w in verdict.culprits else ""))
    # every rank whose left neighbour differs sees it: the lowest of them reports
    seen = [comm.members[q] for q in range(comm.size) if calls[comm.members[q]] and
            calls[comm.members[(q - 1) % comm.size]] and
            _header_key(calls[comm.members[q]]) != _header_key(calls[comm.members[(q - 1) % comm.size]])]
    raise_once(comm, CollectiveMismatchError("\n".join(lines)), min(seen + [comm.world_rank]))


NAMES = {}      # code -> name, for every collective, dtype and op (a rank must decode what it never called)


def register_names(names):
    for name in names:
        NAMES[_code(name)] = name


def _code(text):
    return zlib.crc32(str(text).encode())


for _dt in DTYPE_NAMES:
    NAMES[_code(_dt)] = _dt
OPS = (None, "sum", "mean", "max", "min", "prod")
MAX_DIMS = 6
register_names(COLLECTIVE_NAMES)


_TEMPLATES = {}     # (name, shape, dtype, op, extra) -> its header, but for the sequence number
MAX_TEMPLATES = 4096


def encode_header(record):
    """[name, seq, ndim, dims x 6, dtype, op, extra] as int64 (shape None: ndim -1; the bytes are
    not compared: an all-gather's shards may differ in length). A step calls the same few
    collectives again and again: each one's header is built once, then copied with its seq."""
    key = (record.name, record.shape, record.dtype, record.op, record.extra)
    template = _TEMPLATES.get(key)
    if template is None:
        if len(_TEMPLATES) >= MAX_TEMPLATES:
            _TEMPLATES.clear()
        template = _TEMPLATES[key] = _encode(record)
    header = template.copy()
    header[1] = record.seq
    return header


def _encode(record):
    NAMES.setdefault(_code(record.name), record.name)
    shape = record.shape
    dims = [-1] * MAX_DIMS if shape is None else (list(shape) + [-2] * MAX_DIMS)[:MAX_DIMS]
    dcode = 0 if record.dtype is None else _code(record.dtype)
    if record.dtype is not None:
        NAMES.setdefault(dcode, record.dtype)
    extra = record.extra
    return np.array([_code(record.name), record.seq, -1 if shape is None else len(shape), *dims, dcode,
                     OPS.index(record.op) if record.op in OPS else 9,
                     -(1 << 62) if extra is None else int(extra)], np.int64)


def decode_header(h, comm):
    ndim = int(h[2])
    dtype = NAMES.get(int(h[3 + MAX_DIMS])) if int(h[3 + MAX_DIMS]) else None
    op_index = int(h[4 + MAX_DIMS])
    extra = int(h[5 + MAX_DIMS])
    return {"comm": comm, "seq": int(h[1]), "name": NAMES.get(int(h[0]), f"collective {int(h[0])}"),
            "shape": None if ndim < 0 else tuple(int(d) for d in h[3:3 + min(ndim, MAX_DIMS)]),
            "dtype": dtype, "op": OPS[op_index] if op_index < len(OPS) else "?",
            "extra": None if extra == -(1 << 62) else extra, "nbytes": None,
            "peer": None, "tag": None}


def _header_key(c):
    return (c["name"], c["shape"], c["dtype"], c["op"], c["extra"])

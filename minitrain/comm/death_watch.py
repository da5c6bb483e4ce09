"""The death watch: names a rank that died without a word (SIGKILL, the out-of-memory killer, a
crash in C code, os._exit), and the call it was in.

A rank killed by SIGKILL cannot report anything, and MPICH's launcher (hydra) then kills every other
rank at once, with SIGKILL too, and prints the PID of *a* process, not always the dead one's
(measured with the mpich 5.0.2 wheel). So each rank mirrors its current call into a small
shared-memory slot (~1 us per collective: begin / end below), and one watcher process per
node, started by minitrain.comm.init in a session of its own (the launcher's cleanup does not
reach it), waits on every local rank's pidfd. The first rank to end while its slot says neither
"finished" (left the script) nor "aborting" (reported its own error) is the one that died: the watcher
prints its flight recorder line and the other ranks', then exits. The launcher forwards that text
(hydra waits for the watcher to close its copy of the rank's stderr). Standard library only: the
watcher runs as python -I death_watch.py and starts in ~20 ms.
"""
import mmap
import os
import select
import struct
import sys
import time

SLOT_BYTES = 4096
_HEAD = struct.Struct("<qqqqqqdd")      # pid, status, in_call, seq, name id, comm id, t_start, t_end
_STATUS = struct.Struct("<q")
_CALL_END = struct.Struct("<qqqqdd")     # in_call .. t_end (offset 16)
_NAMES_AT = _HEAD.size
_READY_AT = SLOT_BYTES - 8               # in slot 0: the watcher sets it once it watches every pid
STATUSES = ("running", "finished", "aborting", "failed")
GRACE_S = 0.3                            # how long the watcher collects deaths before it names the first


class Slot:
    """This rank's slot in the node's shared file (the writer side, inside the rank)."""

    def __init__(self, path, index, nslots):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SLOT_BYTES * nslots)
            self.mm = mmap.mmap(fd, SLOT_BYTES * nslots)
        finally:
            os.close(fd)
        self.path, self.base = path, index * SLOT_BYTES
        self.ids, self.names_end = {}, self.base + _NAMES_AT + 4
        self.seq = self.name_id = self.comm_id = 0
        self.t_start = 0.0
        _HEAD.pack_into(self.mm, self.base, os.getpid(), 0, 0, -1, -1, -1, 0.0, 0.0)

    def _id(self, text):
        i = self.ids.get(text)
        if i is None:
            data = text.encode()[:200] + b"\0"
            if self.names_end + len(data) > self.base + SLOT_BYTES:
                return -1                                    # table full: the report says "?"
            self.mm[self.names_end:self.names_end + len(data)] = data
            self.names_end += len(data)
            i = self.ids[text] = len(self.ids)
            struct.pack_into("<i", self.mm, self.base + _NAMES_AT, len(self.ids))
        return i

    def begin(self, comm, seq, name):
        self.seq, self.name_id, self.comm_id, self.t_start = seq, self._id(name), self._id(comm), time.time()
        _CALL_END.pack_into(self.mm, self.base + 16, 1, seq, self.name_id, self.comm_id, self.t_start, 0.0)

    def end(self, ok):
        _CALL_END.pack_into(self.mm, self.base + 16, 0, self.seq, self.name_id, self.comm_id, self.t_start,
                            time.time())

    def set_status(self, status):
        _STATUS.pack_into(self.mm, self.base + 8, STATUSES.index(status) if status in STATUSES else 3)

    def wait_for_watcher(self, seconds):
        """The watcher has opened every rank's pidfd (or ``seconds`` passed): deaths from now on
        are seen in the order they happen."""
        deadline = time.time() + seconds
        while _STATUS.unpack_from(self.mm, _READY_AT)[0] != 1 and time.time() < deadline:
            time.sleep(0.005)
        return _STATUS.unpack_from(self.mm, _READY_AT)[0] == 1


def read_slot(mm, index):
    base = index * SLOT_BYTES
    pid, status, in_call, seq, name_id, comm_id, t_start, t_end = _HEAD.unpack_from(mm, base)
    count = struct.unpack_from("<i", mm, base + _NAMES_AT)[0]
    table = bytes(mm[base + _NAMES_AT + 4:base + SLOT_BYTES]).split(b"\0")[:max(count, 0)]
    names = [t.decode(errors="replace") for t in table]

    def name(i):
        return names[i] if 0 <= i < len(names) else "?"
    return {"pid": pid, "status": STATUSES[status] if 0 <= status < len(STATUSES) else "?",
            "in_call": bool(in_call), "seq": seq, "name": name(name_id), "comm": name(comm_id),
            "t_start": t_start, "t_end": t_end}


def describe(slot, now):
    if slot["seq"] == -1 and slot["name"] == "?":
        return "no call recorded yet"
    call = f"{slot['name']} #{slot['seq']}" if slot["seq"] >= 0 else slot["name"]
    call += "" if slot["comm"] == "world" else f" on {slot['comm']}"
    if slot["in_call"]:
        return f"in {call}, for {now - slot['t_start']:.2f} s"
    return f"computing: its last call, {call}, ended {now - slot['t_end']:.2f} s ago"


def start(path, ranks, pids, slots):
    """Spawn the watcher for the local ranks ``ranks`` (world ranks, their pids and slot indices)."""
    import subprocess
    args = [sys.executable, "-I", os.path.abspath(__file__), path] + [f"{r}:{p}:{s}" for r, p, s in zip(ranks, pids, slots)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def watch(path, entries):
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    try:
        os.unlink(path)                         # every rank has it mapped: nothing left behind
    except OSError:
        pass
    fds = {}
    for rank, pid, slot in entries:
        try:
            fds[os.pidfd_open(pid)] = (rank, pid, slot)
        except (OSError, AttributeError):
            fds[-1 - len(fds)] = (rank, pid, slot)   # no pidfd: polled through /proc
    _STATUS.pack_into(mm, _READY_AT, 1)
    while fds:
        real = [fd for fd in fds if fd >= 0]
        ready, _, _ = select.select(real, [], [], 0.5 if len(real) == len(fds) else 0.1)
        ended = [fd for fd in ready] + [fd for fd in fds if fd < 0 and not _alive(fds[fd][1])]
        if not ended:
            continue
        slots = {rank: read_slot(mm, slot) for rank, _, slot in fds.values()}
        if any(s["status"] == "aborting" for s in slots.values()):
            return                              # a rank is ending the job with its own report
        dead = [fds[fd] for fd in ended if slots[fds[fd][0]]["status"] not in ("finished",)]
        for fd in ended:
            del fds[fd]
        if dead:
            dead += _ended_within(fds, mm, GRACE_S)
            slots = {rank: read_slot(mm, slot) for rank, _, slot in entries}
            if any(s["status"] == "aborting" for s in slots.values()):
                return
            report(_first_first(dead, slots), slots, time.time())
            return


def _ended_within(fds, mm, seconds):
    """The ranks that end in the next ``seconds``: the launcher kills the others the moment one dies,
    and on a loaded machine the pidfd of the one that died first can become readable after theirs."""
    deadline, more = time.time() + seconds, []
    while fds and time.time() < deadline:
        real = [fd for fd in fds if fd >= 0]
        ready, _, _ = select.select(real, [], [], max(0.0, min(0.05, deadline - time.time())))
        for fd in list(ready) + [fd for fd in fds if fd < 0 and not _alive(fds[fd][1])]:
            rank, pid, slot = fds.pop(fd)
            if read_slot(mm, slot)["status"] != "finished":
                more.append((rank, pid, slot))
    return more


def _first_first(dead, slots):
    """Order ranks that ended together so that the one the others were waiting for comes first: a
    rank outside any call, or in an earlier call, stopped before those the launcher killed while they
    waited in a later one (ties keep the order the deaths were seen in)."""
    seen = {d[0]: i for i, d in enumerate(dead)}
    return sorted(dead, key=lambda d: (slots[d[0]]["in_call"], slots[d[0]]["seq"], seen[d[0]]))


def report(dead, slots, now):
    (rank, pid, _), later = dead[0], dead[1:]
    lines = ["[minitrain] flight recorder report (death watch):",
             f"[minitrain]   rank {rank} (pid {pid}) ended without leaving Python: killed by a signal "
             "(SIGKILL, the out-of-memory killer, a crash in C code) or os._exit; it was "
             f"{describe(slots[rank], now)}"]
    for rank, pid, _ in later:
        lines.append(f"[minitrain]   rank {rank} (pid {pid}) ended at about the same time (the launcher ends "
                     f"the other ranks once one dies); it was {describe(slots[rank], now)}")
    for rank in sorted(slots):
        if rank not in {d[0] for d in dead}:
            lines.append(f"[minitrain]   rank {rank}: {describe(slots[rank], now)}")
    lines.append("[minitrain] the launcher ends the other ranks now.")
    os.write(2, ("\n".join(lines) + "\n").encode(errors="replace"))


if __name__ == "__main__":
    watch(sys.argv[1], [tuple(int(v) for v in a.split(":")) for a in sys.argv[2:]])

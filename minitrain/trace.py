"""Spans per rank -> one Chrome-trace / Perfetto JSON, and matplotlib timelines.

with trace.span("ring_all_reduce", kind="comm", bytes=n): records (rank, name, kind, start,
end, args) into the calling thread's tracer when tracing is on (trace.enable(rank)); off, a
span costs one attribute lookup. Times are time.perf_counter() (CLOCK_MONOTONIC, one clock
for every process on a Linux machine), so ranks line up; exports shift them to start at 0. save_chrome(path, comm) gathers every rank's spans to rank 0
through the communicator (duck-typed: this module imports nothing of comm/) and writes one file
that chrome://tracing or ui.perfetto.dev opens, one process row per rank.

On the GPU a span also records a CUDA event at its start and end, so it measures what the device
did, not when the host queued it (kernels run asynchronously): reading the events back
(events(), save_chrome) waits for the GPU once and replaces the span's times by the
device's, on a clock aligned with the host's at the first span (host times kept in args).
Recording an event never makes the host wait, so tracing adds no synchronisation to a step.
"""
import json
import threading
import time
from contextlib import contextmanager

import numpy as np

from . import backend


class Tracer:
    def __init__(self, rank=0):
        self.rank = rank
        self.enabled = False
        self.events = []
        self._lock = threading.Lock()

    def add(self, name, kind, start, end, args, cuda_events=None):
        event = {"rank": self.rank, "name": name, "kind": kind, "start": start, "end": end, "args": args,
                 "thread": threading.current_thread().name}
        if cuda_events is not None:
            event["_cuda"] = cuda_events
        with self._lock:
            if cuda_events is not None and self._reference is None:
                self._reference = (cuda_events[0], start)     # the device clock's zero, in host time
            self.events.append(event)

    _reference = None

    def resolve(self):
        """Give spans timed by CUDA events the device's times (waits for the GPU once)."""
        with self._lock:
            pending = [e for e in self.events if "_cuda" in e]
            if not pending:
                return
            reference, host_zero = self._reference
            backend.elapsed_ms(reference, pending[-1]["_cuda"][1])        # the one wait
            for e in pending:
                first, last = e.pop("_cuda")
                e["args"] = {**e["args"], "host_start": e["start"], "host_end": e["end"]}
                e["start"] = host_zero + backend.elapsed_ms(reference, first, wait=False) / 1e3
                e["end"] = host_zero + backend.elapsed_ms(reference, last, wait=False) / 1e3


_default = Tracer()
_local = threading.local()


def tracer():
    return _local.__dict__.get("tracer") or _default       # (a missing attribute would raise inside: 7x slower)


def set_tracer(t):
    """Make ``t`` the calling thread's tracer (ThreadWorld gives each rank its own)."""
    _local.tracer = t


def enable(rank=None, reset=True):
    t = tracer()
    if rank is not None:
        t.rank = rank
    if reset:
        t.events.clear()
        t._reference = None
    t.enabled = True
    return t


def disable():
    tracer().enabled = False


def events():
    """This thread's tracer's spans (device-timed ones resolved first)."""
    t = tracer()
    t.resolve()
    return list(t.events)


@contextmanager
def span(name, kind="compute", **args):
    t = tracer()
    if not t.enabled:
        yield
        return
    start = time.perf_counter()
    first = backend.record_event()               # None on the CPU
    try:
        yield
    finally:
        end = time.perf_counter()
        t.add(name, kind, start, end, args, None if first is None else (first, backend.record_event()))


def _origin(all_events):
    return min((e["start"] for e in all_events), default=0.0)


def to_chrome(all_events):
    """Chrome trace-event JSON: one process per rank, one thread row per kind (compute / comm)."""
    out = []
    t0 = _origin(all_events)
    for e in all_events:
        out.append({"name": e["name"], "cat": e["kind"], "ph": "X", "pid": e["rank"],
                    "tid": e["kind"], "ts": (e["start"] - t0) * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
                    "args": e.get("args", {})})
    ranks = sorted({e["rank"] for e in all_events})
    for r in ranks:
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def gather_events(comm):
    """Every rank's events on rank 0 (None elsewhere), sent as JSON bytes over ``comm``."""
    mine = np.frombuffer(json.dumps(events()).encode(), dtype=np.uint8).copy()
    if comm.rank != 0:
        comm.send(np.array([mine.size], np.int64), 0, tag=7001)
        comm.send(mine, 0, tag=7002)
        return None
    collected = list(events())
    for peer in range(1, comm.size):
        n = comm.recv(np.empty(1, np.int64), peer, tag=7001)[0]
        data = comm.recv(np.empty(int(n), np.uint8), peer, tag=7002)
        collected.extend(json.loads(data.tobytes().decode()))
    return collected


def save_chrome(path, comm=None):
    """Write one Chrome-trace JSON (all ranks if ``comm`` is given; only rank 0 writes)."""
    all_events = gather_events(comm) if comm is not None else events()
    if all_events is None:
        return None
    with open(path, "w") as f:
        json.dump(to_chrome(all_events), f)
    return path


def _row(e):
    """Timeline row of a span: its rank and kind; collectives run by a progress thread get their own."""
    kind = e["kind"]
    if e.get("thread", "").startswith("progress"):
        kind += " (async)"
    return e["rank"], kind


def plot_timeline(all_events, ax=None, title=None, colors=None, legend=True):
    """Gantt chart: one row per (rank, kind), a bar per span; the legend (one entry per span name)
    sits right of the axes, where it hides no bar."""
    import matplotlib.pyplot as plt
    rows = sorted({_row(e) for e in all_events})
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(rows)))
    colors = colors or {}
    names = sorted({e["name"] for e in all_events})
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")     # no two names share a colour up to 20
    t0 = _origin(all_events)
    for i, row in enumerate(rows):
        for e in all_events:
            if _row(e) != row:
                continue
            color = colors.get(e["name"], palette(names.index(e["name"]) % palette.N))
            ax.barh(i, (e["end"] - e["start"]) * 1e3, left=(e["start"] - t0) * 1e3, color=color,
                    edgecolor="k", lw=0.3)
    ax.set_yticks(range(len(rows)), [f"rank {r} {k}" for r, k in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    if legend:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors.get(n, palette(i % palette.N))) for i, n in enumerate(names)]
        ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    return ax

"""Memory you can see: live and peak bytes per category, per rank.

Categories follow the ZeRO paper's split of training memory (Rajbhandari et al. 2020, sec. 3):
model states (params, grads, optimizer_state) and residual states (activations =
arrays saved for backward, comm_buffers); inference adds kv_cache (the keys and values a
generating model keeps, minitrain/inference/). Each array is counted once, by the buffer that
owns its memory, however many tensors or graph nodes refer to it. set_device_capacity(bytes)
turns the tracker into a teaching device that raises DeviceOutOfMemory when the live total
would exceed it, so "does not fit on one rank" can be shown on a laptop.

Each thread may have its own tracker (use_tracker), so ranks simulated as threads keep
separate accounts.

Host memory (offload, ZeRO-Offload) is accounted beside the device: inside with on_host():
new entries are host entries (host_snapshot()/host_peak()), which the device capacity
does not limit. A Parameter made inside the block keeps its data and gradient on the host.
"""
import contextlib
import threading

CATEGORIES = ("params", "grads", "optimizer_state", "activations", "comm_buffers")   # training's
ALL_CATEGORIES = CATEGORIES + ("kv_cache",)                                             # + inference's


class DeviceOutOfMemory(MemoryError):
    """The teaching device's capacity would be exceeded."""


def owner(a):
    """The array that owns ``a``'s memory (``a`` itself unless it is a view)."""
    while a.base is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


class MemoryTracker:
    """Counts bytes per category. Entries are keyed, and each key is reference-counted, so an
    array saved by three graph nodes is counted once and released when the last one lets go."""

    def __init__(self):
        self._entries = {}      # key -> [category, nbytes, refcount, on_host]
        self.capacity = None
        self.placing_on_host = False      # set by on_host()
        self.reset()

    def reset(self):
        self._entries.clear()
        self.live = dict.fromkeys(ALL_CATEGORIES, 0)
        self.live_total = 0
        self.peak_by_category = dict.fromkeys(ALL_CATEGORIES, 0)
        self.peak_total = 0
        self.host_live = dict.fromkeys(ALL_CATEGORIES, 0)
        self.host_peak_by_category = dict.fromkeys(ALL_CATEGORIES, 0)

    def add(self, category, key, nbytes, host=None):
        """Count ``nbytes`` of ``category`` under ``key`` (on the host if ``host``, or if inside
        ``on_host()`` when ``host`` is None)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry[2] += 1
            return
        if host if host is not None else self.placing_on_host:
            self._entries[key] = [category, nbytes, 1, True]
            self.host_live[category] += nbytes
            self.host_peak_by_category[category] = max(self.host_peak_by_category[category],
                                                       self.host_live[category])
            return
        if self.capacity is not None and self.live_total + nbytes > self.capacity:
            raise DeviceOutOfMemory(
                f"allocating {nbytes:,} bytes of {category} would exceed the device capacity of "
                f"{self.capacity:,} bytes (live: {self._live_summary()})")
        self._entries[key] = [category, nbytes, 1, False]
        live = self.live[category] + nbytes
        self.live[category] = live
        self.live_total += nbytes
        if live > self.peak_by_category[category]:
            self.peak_by_category[category] = live
        if self.live_total > self.peak_total:
            self.peak_total = self.live_total

    def remove(self, key):
        entry = self._entries.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del self._entries[key]
            if entry[3]:
                self.host_live[entry[0]] -= entry[1]
                return
            self.live[entry[0]] -= entry[1]
            self.live_total -= entry[1]

    def contains(self, key):
        return key in self._entries

    def free_bytes(self):
        """What the device can still take (None: no capacity set, unlimited)."""
        return None if self.capacity is None else self.capacity - self.live_total

    # ---- activations: arrays saved for backward, keyed by the buffer that owns their memory
    def add_saved(self, arrays):
        """Count arrays saved for backward; returns the keys to pass to ``remove_saved``.
        Arrays that are parameters' storage are not activations and are skipped."""
        keys = []
        for a in arrays:
            if not hasattr(a, "nbytes"):
                continue
            base = owner(a)
            key = id(base)
            if ("params", key) in self._entries:
                continue
            self.add("activations", ("activations", key), base.nbytes)
            keys.append(("activations", key))
        return keys

    def remove_saved(self, keys):
        for key in keys:
            self.remove(key)

    # ---- reports
    def snapshot(self):
        """Live bytes per category and in total."""
        return {**self.live, "total": self.live_total}

    def peak(self):
        """Peak bytes per category (each its own maximum) and the peak of the total."""
        return {**self.peak_by_category, "total": self.peak_total}

    def reset_peak(self):
        self.peak_by_category = dict(self.live)
        self.peak_total = self.live_total
        self.host_peak_by_category = dict(self.host_live)

    def host_snapshot(self):
        """Live host bytes per category (offloaded model states) and in total."""
        return {**self.host_live, "total": sum(self.host_live.values())}

    def host_peak(self):
        return {**self.host_peak_by_category, "total": sum(self.host_peak_by_category.values())}

    def _live_summary(self):
        return ", ".join(f"{c}={b:,}" for c, b in self.live.items() if b)


_default = MemoryTracker()
_local = threading.local()


def tracker():
    """The tracker of the calling thread (the process-wide one unless ``use_tracker`` set another)."""
    return _local.__dict__.get("tracker") or _default      # (a missing attribute would raise inside: 7x slower)


@contextlib.contextmanager
def use_tracker(t):
    """Make ``t`` the calling thread's tracker inside the block (one per simulated rank)."""
    old = getattr(_local, "tracker", None)
    _local.tracker = t
    try:
        yield t
    finally:
        _local.tracker = old


@contextlib.contextmanager
def on_host():
    """Inside the block, what is allocated is host memory (offload)."""
    t = tracker()
    old = t.placing_on_host
    t.placing_on_host = True
    try:
        yield t
    finally:
        t.placing_on_host = old


def snapshot():
    return tracker().snapshot()


def host_snapshot():
    return tracker().host_snapshot()


def host_peak():
    return tracker().host_peak()


def peak():
    return tracker().peak()


def reset_peak():
    tracker().reset_peak()


def set_device_capacity(nbytes):
    """Give the current tracker a capacity in bytes (None: unlimited). DeviceOutOfMemory if what is already on
    the device exceeds it (a capacity below the model's own states would otherwise fail later, on whatever
    allocation came next)."""
    t = tracker()
    if nbytes is not None and t.live_total > nbytes:
        raise DeviceOutOfMemory(f"what is already on the device, {t.live_total:,} bytes ({t._live_summary()}), "
                                f"exceeds the device capacity of {int(nbytes):,} bytes")
    t.capacity = None if nbytes is None else int(nbytes)

"""CommStats: bytes and messages a communicator moved, in total and per collective name."""
import threading


class CommStats:
    """Bytes and messages, in total and per collective name ("p2p" outside collectives)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self.bytes_sent = self.bytes_received = 0
            self.messages_sent = self.messages_received = 0
            self.by_name = {}

    def _entry(self, name):
        entry = self.by_name.get(name)
        if entry is None:
            entry = self.by_name[name] = {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                                          "messages_received": 0, "calls": 0}
        return entry

    def record(self, name, nbytes, direction, total=True):
        """Count one message; ``direction`` is "sent" or "received". ``total=False``: only under
        ``name`` (check_collectives' headers: the totals stay the algorithms' bytes)."""
        sent = direction == "sent"            # (spelled out: every message passes here)
        with self._lock:
            e = self._entry(name)
            if sent:
                e["bytes_sent"] += nbytes
                e["messages_sent"] += 1
                if total:
                    self.bytes_sent += nbytes
                    self.messages_sent += 1
            else:
                e["bytes_received"] += nbytes
                e["messages_received"] += 1
                if total:
                    self.bytes_received += nbytes
                    self.messages_received += 1

    def record_call(self, name):
        with self._lock:
            self._entry(name)["calls"] += 1

    def __getitem__(self, name):
        """A copy of the counters of one collective (zeros if it never ran)."""
        with self._lock:
            entry = self.by_name.get(name)
            return dict(entry) if entry else {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                                              "messages_received": 0, "calls": 0}

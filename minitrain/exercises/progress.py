"""What the learner has done: a small JSON file in the user's cache directory.

Where: $MINITRAIN_EXERCISES_PROGRESS if set, else $XDG_CACHE_HOME/minitrain/exercises.json, else
~/.cache/minitrain/exercises.json (the CLI's --progress PATH overrides all three). Its content:

  {"version": 1,
   "exercises": {"ring_all_reduce": {"passed": true, "passed_at": "2025-01-31T10:00:00",
                                     "attempts": 3, "last_checked": "...", "last_path": "/home/.../mine.py",
                                     "hints_read": 2}}}

A file that cannot be read or written never stops grading: the grader says so and goes on. One it cannot
read is never written over: the first save moves it to exercises.json.unreadable.
"""
import contextlib
import datetime
import json
import os
import pathlib

ENV = "MINITRAIN_EXERCISES_PROGRESS"


def default_path():
    if os.environ.get(ENV):
        return pathlib.Path(os.environ[ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "minitrain" / "exercises.json"


def _well_formed(data):
    """The layout save() writes: every exercise's entry a dict, "passed" a bool, the counts integers >= 0."""
    if not isinstance(data, dict) or not isinstance(data.get("exercises"), dict):
        return False
    for entry in data["exercises"].values():
        if not isinstance(entry, dict) or not isinstance(entry.get("passed", False), bool):
            return False
        counts = (entry.get("attempts", 0), entry.get("hints_read", 0))
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
            return False
    return True


class Progress:
    def __init__(self, path=None):
        self.path = pathlib.Path(path) if path else default_path()
        self.warning = None
        self.data = {"version": 1, "exercises": {}}
        self.kept_as = None           # a file there that could not be read: moved to this name at the first save
        self.not_a_file = self.path.exists() and not self.path.is_file()
        if self.not_a_file:           # a folder; a named pipe, whose read would wait forever
            self.warning = f"the progress file {self.path} is not a file; progress is not saved"
            return
        try:
            with open(self.path) as f:
                data = json.load(f)
            if _well_formed(data):
                self.data = data
                return
            problem = "has an unexpected layout"
        except FileNotFoundError:
            return
        except ValueError as e:       # not JSON, not UTF-8
            problem = f"is not valid JSON ({e})"
        except OSError as e:
            self.warning = f"cannot read the progress file {self.path} ({e.strerror or e}); starting afresh"
            return
        self.kept_as = self.path.with_name(self.path.name + ".unreadable")
        self.warning = (f"the progress file {self.path} {problem}; starting afresh (the file is kept as "
                        f"{self.kept_as} when progress is saved)")

    def entry(self, name):
        return self.data["exercises"].setdefault(name, {"passed": False, "attempts": 0, "hints_read": 0})

    def get(self, name):
        return self.data["exercises"].get(name, {"passed": False, "attempts": 0, "hints_read": 0})

    def record_check(self, name, passed, path):
        e = self.entry(name)
        now = datetime.datetime.now().isoformat(timespec="seconds")
        e["attempts"] = e.get("attempts", 0) + 1
        e["last_checked"] = now
        e["last_path"] = str(pathlib.Path(path).resolve())
        if passed:
            e["passed"] = True
            e["passed_at"] = now
        return self.save()

    def record_hint(self, name, level):
        e = self.entry(name)
        e["hints_read"] = max(e.get("hints_read", 0), level)
        return self.save()

    def save(self):
        """Write atomically; returns None, or a warning when the file cannot be written."""
        if self.not_a_file:                       # said once, when it was read
            return None
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            if self.kept_as is not None:          # never written over: the learner may mend it by hand
                os.replace(self.path, self.kept_as)
                self.kept_as = None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):    # no half-written file left beside it
                tmp.unlink()
            return f"could not save progress to {self.path} ({e.strerror or e})"
        return None

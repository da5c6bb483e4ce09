"""What the learner has done: a small JSON file in the user's cache directory.

Where: $MINITRAIN_EXERCISES_PROGRESS if set, else $XDG_CACHE_HOME/minitrain/exercises.json, else
~/.cache/minitrain/exercises.json (the CLI's --progress PATH overrides all three). Its content:

  {"version": 1,
   "exercises": {"ring_all_reduce": {"passed": true, "passed_at": "2025-01-31T10:00:00",
                                     "attempts": 3, "last_checked": "...", "last_path": "/home/.../mine.py",
                                     "hints_read": 2}}}

A file that cannot be read or written never stops grading: the grader says so and goes on.
"""
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


class Progress:
    def __init__(self, path=None):
        self.path = pathlib.Path(path) if path else default_path()
        self.warning = None
        self.data = {"version": 1, "exercises": {}}
        try:
            with open(self.path) as f:
                data = json.load(f)
            if isinstance(data, dict) and isinstance(data.get("exercises"), dict):
                self.data = data
            else:
                self.warning = f"progress file {self.path} has an unexpected layout; starting afresh"
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            self.warning = f"cannot read the progress file {self.path} ({e}); starting afresh"

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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".json.tmp")
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            return f"could not save progress to {self.path} ({e.strerror or e})"
        return None

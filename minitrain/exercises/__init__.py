"""Exercises graded by minitrain's own tests: python -m minitrain.exercises list | show NAME |
hint NAME | stub NAME DEST | check NAME PATH | run NAME [PATH].

One module per exercise lives in catalog/ (registry.py says what it defines); grading.py holds
checks, results and explanations (comparing.py: of arrays; loading.py imports the learner's file);
harness.py runs rank code on ThreadWorld so that a learner's hang or crash is reported, never
inherited; isolation.py grades in a child process, so that a hand-in ending its process is a verdict
too; progress.py remembers what passed. The same checks grade the library's own
implementation (check NAME --reference), as in Stanford CS336.
"""
from .registry import Exercise, UnknownExercise, all_exercises, get, names

__all__ = ["Exercise", "UnknownExercise", "all_exercises", "get", "names"]

"""The exercises, found by looking: every module in minitrain/exercises/catalog/ is one exercise.

Adding an exercise is adding one module there. It defines:

  TITLE     one line: what the learner builds
  ORDER     its place on the learning path (the list is sorted by it)
  KIND      "implement" (write a piece of minitrain) or "debug" (fix a broken program)
  NOTEBOOK  the walkthrough that explains the idea, e.g. "02_collectives" (or None)
  DEFINES   the name(s) the learner's file must define (a str, or a tuple of str)
  STUB      the starting file: signature, contract and the test to pass, never the solution
  HINTS     progressive hints, the first one gentle, the last one nearly the answer
  checks()  the grader: a list of grading.Check
  reference()  minitrain's own implementation, in the shape DEFINES describes
and a debugging exercise also run(impl, p): runs the program and prints what minitrain reports.
"""
import ast
import importlib
import pkgutil

from . import catalog
from .grading import run_checks
from .loading import load

KINDS = ("implement", "debug")


class UnknownExercise(LookupError):
    """No exercise has that name (the message lists the closest ones)."""


class Exercise:
    def __init__(self, module):
        self.module = module
        self.name = module.__name__.rsplit(".", 1)[-1]
        for attribute in ("TITLE", "ORDER", "KIND", "DEFINES", "STUB", "HINTS", "checks", "reference"):
            if not hasattr(module, attribute):
                raise AttributeError(f"exercise {self.name}: its module defines no {attribute}")
        self.title, self.order, self.kind = module.TITLE, module.ORDER, module.KIND
        self.notebook = getattr(module, "NOTEBOOK", None)
        self.defines, self.stub, self.hints = module.DEFINES, module.STUB, tuple(module.HINTS)
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.name}: KIND must be one of {KINDS}, got {self.kind!r}")

    def checks(self):
        return self.module.checks()

    def reference(self):
        return self.module.reference()

    def load(self, path):
        return load(path, self.defines)

    def grade(self, impl, fail_fast=False, on_start=None, on_result=None):
        return run_checks(self.checks(), impl, fail_fast=fail_fast, on_start=on_start, on_result=on_result)

    def run(self, impl, p=None):
        if not hasattr(self.module, "run"):
            raise AttributeError(f"{self.name} is not a debugging exercise: nothing to run")
        return self.module.run(impl, p)

    def intro(self):
        """The stub's docstring: the exercise text."""
        return ast.get_docstring(ast.parse(self.stub)) or ""

    def signatures(self):
        """What the learner writes: 'def name(args)' / 'class Name(bases)' lines of the stub, with methods."""
        lines = []
        for node in ast.parse(self.stub).body:
            if isinstance(node, ast.FunctionDef):
                lines.append(f"def {node.name}({ast.unparse(node.args)})")
            elif isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                lines.append(f"class {node.name}" + (f"({bases})" if bases else ""))
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        lines.append(f"    def {item.name}({ast.unparse(item.args)})")
        return lines


_cache = []


def all_exercises():
    """Every exercise, in learning-path order."""
    if not _cache:
        found = []
        for info in pkgutil.iter_modules(catalog.__path__):
            found.append(Exercise(importlib.import_module(f"{catalog.__name__}.{info.name}")))
        found.sort(key=lambda e: (e.order, e.name))
        _cache.extend(found)
    return list(_cache)


def names():
    return [e.name for e in all_exercises()]


def get(name):
    for e in all_exercises():
        if e.name == name:
            return e
    import difflib
    close = difflib.get_close_matches(name, names(), n=3)
    raise UnknownExercise(f"no exercise called {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                   + "; python -m minitrain.exercises list shows them all")

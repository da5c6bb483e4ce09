"""How a grader speaks: checks, results, and explanations a teacher would give.

A grader is a list of Check(label, run, hint): run(impl) returns None when the learner's code
passes, raises Mismatch (the grader's own explanation: which rank, which element, expected vs
got) when it does not, or lets whatever the learner's code raised fly; run_checks turns every
outcome into a Result, so nothing a hand-in does can crash the grader. Comparing arrays and
explaining their difference is comparing.py's; importing the learner's file, loading.py's.
"""
import contextlib
import ctypes
import dataclasses
import gc
import os
import pathlib
import sys
import threading
import time
import traceback

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent      # minitrain/


class Mismatch(AssertionError):
    """The learner's code ran but did not do what the contract says (the message says how)."""


class Skipped(Exception):
    """A check that cannot run here (e.g. the PyTorch oracle without torch)."""


class LoadError(Exception):
    """The learner's file cannot be graded (missing, unreadable, syntax error, name missing)."""


@dataclasses.dataclass
class Check:
    label: str
    run: object          # run(impl) -> None, raises Mismatch / anything
    hint: int = 1        # the hint level to read when this check fails


@dataclasses.dataclass
class Result:
    label: str
    status: str          # "pass", "fail" or "skip"
    explanation: str = ""
    hint: int = None


class StopGrading(Exception):
    """Raised by a check after which nothing can run (the learner's threads are still running)."""


class Stopped(BaseException):
    """Injected into a thread of the learner's code that ran past its time limit."""


def stop_thread(ident):
    """Raise Stopped in the thread ``ident`` at its next Python instruction (an endless loop ends)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(Stopped))


def current_frames():
    """``sys._current_frames()`` with the garbage collector paused: on CPython 3.11 a collection
    inside it, while another thread exits, deadlocks the process (python/cpython#106883; seen here
    when a grader stopped an endless loop)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


_untimed = {"done": 0.0, "since": None}


@contextlib.contextmanager
def untimed():
    """Time that no check's limit counts: importing PyTorch for an oracle (4 s here, warm; more, cold)."""
    _untimed["since"] = time.monotonic()
    try:
        yield
    finally:
        _untimed["done"] += time.monotonic() - _untimed["since"]
        _untimed["since"] = None


def _untimed_so_far():
    since = _untimed["since"]
    return _untimed["done"] + (0.0 if since is None else time.monotonic() - since)


def call_with_limit(fn, impl, limit, what="your code"):
    """``fn(impl)`` on a daemon thread; a call still running after ``limit`` seconds (not counting
    untimed() ones) is stopped and reported (StopGrading: ``what`` did not finish, and the line it was
    running), so no hand-in can hang the grader."""
    box = {}

    def target():
        try:
            fn(impl)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, name="grader-check", daemon=True)
    thread.start()
    excused, deadline = _untimed_so_far(), time.monotonic() + limit
    while thread.is_alive():
        left = deadline + _untimed_so_far() - excused - time.monotonic()
        if left <= 0:
            break
        thread.join(left)
    if thread.is_alive():
        frame = current_frames().get(thread.ident)
        at = where(traceback.extract_stack(frame)) if frame is not None else "an unknown line"
        stop_thread(thread.ident)
        thread.join(2.0)
        raise StopGrading(f"{what} did not finish within {limit:g} s (an endless loop?); it was running at "
                          f"{at}. Grading stopped here.")
    if "error" in box:
        error = box["error"]
        if isinstance(error, KeyboardInterrupt):    # raised by the code, not typed by the user (see run_checks)
            error.raised_by_code = True
        raise error


# Every correct hand-in's and reference's check ends within 0.2 s on a busy 2-core machine, PyTorch's
# import aside (untimed); a check's limit stays above a world's, whose own report says more.
CHECK_LIMIT_S = 10.0


def check_limit():
    """Seconds one check may run: CHECK_LIMIT_S, or a world's limit and 2 s if that is longer."""
    from .harness import world_limit
    return max(CHECK_LIMIT_S, world_limit() + 2)


def run_checks(checks, impl, fail_fast=False, limit=None, on_start=None, on_result=None):
    """Every check on ``impl``; returns a list of Results. Catches anything the learner's code raises;
    a check that runs longer than ``limit`` seconds is stopped and ends the grading. on_start(check)
    and on_result(result), when given, are told as each check starts and ends."""
    limit = check_limit() if limit is None else limit
    results = []
    for check in checks:
        if on_start:
            on_start(check)
        stopped = False
        try:
            call_with_limit(check.run, impl, limit)
            result = Result(check.label, "pass")
        except Skipped as e:
            result = Result(check.label, "skip", str(e))
        except StopGrading as e:
            result, stopped = Result(check.label, "fail", str(e), check.hint), True   # its threads may still run
        except BaseException as e:       # the learner's code may raise anything (SystemExit too)
            if isinstance(e, KeyboardInterrupt) and not getattr(e, "raised_by_code", False):
                raise                    # the user's Ctrl-C
            result = Result(check.label, "fail", explain(e), check.hint)
        results.append(result)
        if on_result:
            on_result(result)
        if stopped or (fail_fast and result.status == "fail"):
            break
    return results


# ---------------------------------------------------------------- explanations of exceptions
def _is_learner_frame(filename):
    path = pathlib.Path(filename)
    if not path.suffix == ".py" or filename.startswith("<"):
        return False
    try:
        path.resolve().relative_to(PACKAGE_DIR)
        return False                     # minitrain's own code
    except ValueError:
        pass
    if {"site-packages", "dist-packages", "cupy", "cupyx"} & set(path.parts):
        return False                     # NumPy, CuPy (or its stand-in), mpi4py, torch
    stdlib = pathlib.Path(os.__file__).resolve().parent
    try:
        path.resolve().relative_to(stdlib)
        return False
    except ValueError:
        return True


def _in_graders(filename):
    try:
        pathlib.Path(filename).resolve().relative_to(pathlib.Path(__file__).resolve().parent)
        return True
    except ValueError:
        return False


def where(tb_or_frames):
    """'file.py line N: source' of the deepest frame in the learner's code (else the deepest of all)."""
    frames = tb_or_frames if isinstance(tb_or_frames, list) else traceback.extract_tb(tb_or_frames)
    if not frames:
        return ""
    mine = [f for f in frames if _is_learner_frame(f.filename)]
    frame = mine[-1] if mine else frames[-1]
    name = pathlib.Path(frame.filename).name if mine else frame.filename
    line = (frame.line or "").strip()
    return f"{name} line {frame.lineno}" + (f": {line}" if line else "")


def explain(e):
    """A few lines on an exception: the grader's own message, or what the learner's code raised and where."""
    if isinstance(e, Mismatch):
        return str(e)
    if getattr(e, "explained", False):               # the harness already wrote the explanation
        return str(e)
    if isinstance(e, NotImplementedError):
        return f"not written yet: {e}" if str(e) else "not written yet (NotImplementedError)"
    first = str(e).strip() or "(no message)"
    frames = traceback.extract_tb(e.__traceback__)
    if frames and not any(_is_learner_frame(f.filename) for f in frames) and _in_graders(frames[-1].filename):
        return (f"the grader could not use the result ({type(e).__name__}: {first}, in {where(frames)}); "
                "check what your code returns against the contract (if it is right, this is a grader bug)")
    text = f"your code raised {type(e).__name__}: {first}"
    at = where(e.__traceback__)
    if at:
        text += f"\n  at {at}"
    if mixes_host_and_device(e):
        text += ("\n  On the GPU, NumPy and CuPy arrays do not mix: make new arrays with the input's module, "
                 "xp = minitrain.backend.array_module(x) (xp.zeros, xp.concatenate), never np, and copy "
                 "between host and GPU only on purpose (minitrain.backend.to_host / to_device)")
    return text


MIXING = ("Unsupported type <class 'numpy.ndarray'>", "Implicit conversion to a NumPy array",
          "non-scalar numpy.ndarray cannot be used")


def mixes_host_and_device(e):
    """True when ``e`` is CuPy refusing a NumPy array (or NumPy refusing a CuPy one)."""
    return isinstance(e, (TypeError, ValueError)) and any(m in str(e) for m in MIXING)


def require(condition, message):
    if not condition:
        raise Mismatch(message)

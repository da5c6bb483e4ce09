"""How a grader speaks: checks, results, and explanations a teacher would give.

A grader is a list of Check(label, run, hint): run(impl) returns None when the learner's code
passes, raises Mismatch (the grader's own explanation: which rank, which element, expected vs
got) when it does not, or lets whatever the learner's code raised fly; run_checks turns every
outcome into a Result, so nothing a hand-in does can crash the grader. compare() writes the
explanation for two arrays (first wrong element, how many, which chunk, "p times too large").
"""
import ctypes
import dataclasses
import gc
import importlib.util
import os
import pathlib
import sys
import threading
import traceback

import numpy as np

from minitrain import backend

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


def call_with_limit(fn, impl, limit):
    """``fn(impl)`` on a daemon thread; a call still running after ``limit`` seconds is stopped and
    reported (StopGrading, with the line it was running), so no hand-in can hang the grader."""
    box = {}

    def target():
        try:
            fn(impl)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, name="grader-check", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        frame = current_frames().get(thread.ident)
        at = where(traceback.extract_stack(frame)) if frame is not None else "an unknown line"
        stop_thread(thread.ident)
        thread.join(2.0)
        raise StopGrading(f"your code did not finish within {limit:g} s (an endless loop?); it was running at "
                          f"{at}. Grading stopped here.")
    if "error" in box:
        raise box["error"]


CHECK_LIMIT_S = 30.0        # at least this long for one check (a check may run several worlds)


def run_checks(checks, impl, fail_fast=False, limit=None):
    """Every check on ``impl``; returns a list of Results. Catches anything the learner's code raises;
    a check that runs longer than ``limit`` seconds is stopped and ends the grading."""
    from .harness import WALL_FACTOR, wait_timeout
    limit = max(CHECK_LIMIT_S, 2 * WALL_FACTOR * wait_timeout()) if limit is None else limit
    results = []
    for check in checks:
        try:
            call_with_limit(check.run, impl, limit)
            results.append(Result(check.label, "pass"))
        except KeyboardInterrupt:
            raise
        except Skipped as e:
            results.append(Result(check.label, "skip", str(e)))
        except StopGrading as e:
            results.append(Result(check.label, "fail", str(e), check.hint))
            break
        except BaseException as e:       # the learner's code may raise anything (SystemExit too)
            results.append(Result(check.label, "fail", explain(e), check.hint))
            if fail_fast:
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


# ---------------------------------------------------------------- comparing arrays
def _fmt(x):
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.6g}"
    return repr(x.item() if hasattr(x, "item") else x)


def on_gpu():
    """True when the learner's code runs on the GPU (MINITRAIN_DEVICE=cuda, or backend.set_device)."""
    return backend.get_device() == "cuda"


def to_learner(a):
    """A fresh copy of the host array ``a`` where the learner's code runs: on the GPU when the device
    is cuda (an explicit, counted host -> device copy), else on the host."""
    a = np.array(a)
    return backend.to_device(a) if on_gpu() else a


def host(a):
    """``a`` as a NumPy array, copied from the GPU on purpose (backend.to_host) when it lives there:
    graders compare on the host. A minitrain Tensor gives its array; None stays None."""
    if a is None:
        return None
    if hasattr(a, "data") and hasattr(a, "requires_grad"):          # a minitrain Tensor
        a = a.data
    return backend.to_host(a) if backend.is_device_array(a) else np.asarray(a)


def host_all(value):
    """``value`` with every array in it (in tuples, lists and dicts, at any depth) copied to the host
    by host(): what a program returned, ready to compare with NumPy."""
    if isinstance(value, (tuple, list)):
        return type(value)(host_all(v) for v in value)
    if isinstance(value, dict):
        return {k: host_all(v) for k, v in value.items()}
    if backend.is_device_array(value) or (hasattr(value, "data") and hasattr(value, "requires_grad")):
        return host(value)
    return value


def as_array(value, what):
    """The learner's return value as a host ndarray (copied from the GPU on purpose), or a Mismatch
    saying what came back instead: on the GPU, a NumPy array means the code left the device."""
    if backend.is_device_array(value):
        return backend.to_host(value)
    if isinstance(value, np.ndarray):
        if on_gpu():
            raise Mismatch(f"{what}: returned a NumPy array (host memory), but your inputs were on the GPU "
                           "(MINITRAIN_DEVICE=cuda): compute with the inputs' own array module, "
                           "xp = minitrain.backend.array_module(x), not np, and return the GPU's array")
        return value
    if hasattr(value, "numpy") and hasattr(value, "shape"):     # a minitrain or torch Tensor
        raise Mismatch(f"{what}: returned a {type(value).__name__}, expected " + kind_of_array()
                       + " (use .data for a minitrain Tensor's array)")
    raise Mismatch(f"{what}: returned {type(value).__name__} {value!r:.60}, expected {kind_of_array()}")


def kind_of_array():
    """What the contract's arrays are here: NumPy's on the CPU, CuPy's on the GPU."""
    return "a CuPy array (the inputs' module)" if on_gpu() else "a NumPy array"


def is_array(x):
    """True for an array of the kind the learner's code works with here (kind_of_array())."""
    return backend.is_device_array(x) if on_gpu() else isinstance(x, np.ndarray)


def compare(got, want, what, rtol=1e-10, atol=1e-12, exact=False, chunks=None, ranks=None):
    """None if ``got`` equals ``want`` (exactly, or to rtol/atol); else a teacher's explanation:
    shape or dtype, the first wrong element, how many are wrong, whether they sit in one chunk
    (``chunks`` = np.array_split count), and whether ``got`` is ``ranks`` times too large or small."""
    # a learner's raw return value is checked by as_array (on the GPU it must stay there); one already
    # copied to the host by as_array / unpack is compared as it is
    got = np.asarray(got) if isinstance(got, np.ndarray) else as_array(got, what)
    want = host(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, expected {want.shape}"
    if exact and got.dtype != want.dtype:
        return f"{what}: dtype {got.dtype}, expected {want.dtype}"
    g = got.astype(np.float64) if got.dtype.kind in "fiub" or got.dtype.name in ("bfloat16",) else got
    w = want.astype(np.float64) if want.dtype.kind in "fiub" or want.dtype.name in ("bfloat16",) else want
    if exact:
        wrong = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    else:
        wrong = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if not wrong.any():
        return None
    flat_wrong = np.flatnonzero(wrong.reshape(-1))
    first = int(flat_wrong[0])
    shown = tuple(int(i) for i in np.unravel_index(first, got.shape)) if got.ndim > 1 else first
    text = (f"{what}: element {shown} is {_fmt(g.reshape(-1)[first])}, expected {_fmt(w.reshape(-1)[first])} "
            f"({flat_wrong.size} of {got.size} elements wrong")
    if not np.isfinite(g).all() and np.isfinite(w).all():
        text += "; your result has inf or NaN"
    text += ")"
    if chunks and got.ndim == 1 and chunks > 1:
        bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(got.size), chunks)])
        bad = sorted({int(np.searchsorted(bounds, i, side="right") - 1) for i in flat_wrong})
        text += f"; wrong chunk(s) of np.array_split(..., {chunks}): {bad}"
    nonzero = w != 0
    if nonzero.any() and np.isfinite(g).all():
        ratios = g[nonzero] / w[nonzero]
        r = float(np.median(ratios))
        telling = ranks and (np.isclose(r, ranks) or np.isclose(r, 1.0 / ranks))
        if np.allclose(ratios, r, rtol=1e-6) and not np.isclose(r, 1.0) and (ratios.size > 1 or telling):
            text += f"; every element is {r:.4g} times the expected one"
            if ranks and np.isclose(r, ranks):
                text += f" = p ({ranks}): summed over the ranks where a mean was due, or summed twice?"
            elif ranks and np.isclose(r, 1.0 / ranks):
                text += f" = 1/p (p = {ranks}): averaged where a sum was due, or divided by p once too often?"
        elif np.allclose(g, 0.0):
            text += "; your result is all zeros"
    return text


def require(condition, message):
    if not condition:
        raise Mismatch(message)


# ---------------------------------------------------------------- loading the learner's file
def load(path, names):
    """Import the learner's file and return the object(s) named ``names`` (a str or a tuple).
    Raises LoadError with a clear message for every way this can go wrong."""
    path = pathlib.Path(path)
    if not path.exists():
        raise LoadError(f"cannot read {path}: no such file (write one with "
                        "python -m minitrain.exercises stub NAME DEST)")
    if path.is_dir():
        raise LoadError(f"cannot read {path}: it is a directory, not a Python file")
    try:
        source = path.read_bytes().decode("utf-8")
    except PermissionError:
        raise LoadError(f"cannot read {path}: permission denied") from None
    except UnicodeDecodeError as e:
        raise LoadError(f"cannot read {path}: not UTF-8 text (byte {e.start}); is it a Python file?") from None
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        compile(source, str(path), "exec")
    except SyntaxError as e:
        line = (e.text or "").rstrip("\n")
        raise LoadError(f"{path} line {e.lineno}: {e.msg}" + (f"\n    {line}" if line else "")) from None
    module_name = f"minitrain_exercise_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module        # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise LoadError(f"{path} raised {type(e).__name__} while being imported: {e}\n"
                        f"  at {where(e.__traceback__)}") from None
    single = isinstance(names, str)
    found = []
    for name in ([names] if single else names):
        if not hasattr(module, name):
            defined = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise LoadError(f"{path} defines no {name} (the grader looks for that name; "
                            f"it defines: {', '.join(defined) or 'nothing callable'})")
        obj = getattr(module, name)
        if not callable(obj):
            raise LoadError(f"{path}: {name} is a {type(obj).__name__}, expected a function or a class")
        found.append(obj)
    return found[0] if single else tuple(found)

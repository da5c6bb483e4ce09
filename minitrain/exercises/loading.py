"""Loading the learner's file: import it and hand back the names the grader asks for, or one
clear LoadError for every way that can go wrong (missing, unreadable, a syntax error, a name missing).
"""
import importlib.util
import pathlib
import sys

from .grading import LoadError, StopGrading, call_with_limit, where

IMPORT_LIMIT_S = 30.0       # a learner's file may import PyTorch or CuPy itself, from a cold disk


def load(path, names, limit=IMPORT_LIMIT_S):
    """Import the learner's file and return the object(s) named ``names`` (a str or a tuple).
    Raises LoadError with a clear message for every way this can go wrong, an import that runs longer
    than ``limit`` seconds included."""
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
    try:        # the file's own top-level code runs too: bounded like a check, so none can hang the grader
        call_with_limit(spec.loader.exec_module, module, limit, what=f"importing {path}")
    except KeyboardInterrupt as e:
        if not getattr(e, "raised_by_code", False):      # the user's Ctrl-C
            raise
        raise LoadError(f"{path} raised KeyboardInterrupt while being imported\n  at {where(e.__traceback__)}") from None
    except StopGrading as e:
        raise LoadError(f"{e} (the grader imports the file, which runs its top-level code: keep your own "
                        f"tests under if __name__ == \"__main__\":)") from None
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

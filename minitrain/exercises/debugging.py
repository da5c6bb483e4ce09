"""What the debugging exercises share: their broken programs, how they run, how they are judged.

A debugging exercise's STUB is a program broken on purpose; FIX lists the (broken, fixed) lines
that repair it, so the fixed program (the exercise's reference) differs from the broken one by
exactly the fix. Its compare(p, results) returns the differences from one process, in words.

  run NAME [PATH]     run the program on ThreadWorld and print what minitrain reports: each rank's
                      error and the line it waited at, or the differences from one process;
  check NAME PATH     the same runs at p = 1..4, graded;
  python mine.py      the same as run; under mpiexec -n N python mine.py each rank runs train on
                      MPI, minitrain's own timeout and abort report a hang.
"""
import linecache
import os
import types

from .comparing import host_all
from .grading import Check, Mismatch, StopGrading
from .harness import RanksFailed, mpi_world, rank_wait, run_ranks


def load_program(name, source, fixes=(), label="broken"):
    """The program ``source`` (with ``fixes`` applied) as a module; its lines show in tracebacks."""
    for broken, fixed in fixes:
        if broken not in source:
            raise ValueError(f"{name}: the fix {broken!r} does not match the program")
        source = source.replace(broken, fixed)
    filename = f"{name}_{label}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"minitrain_exercise_{name}_{label}")
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def _call(comm, train):
    return train(comm)


def program_checks(compare, sizes=(1, 2, 3, 4), hint=1, label="runs to the end and equals one process", call=_call):
    """One Check per world size: the program must finish and compare() must find no difference.
    ``call(comm, train)`` runs the program on one rank (default: train(comm))."""
    def make(p):
        def check(train):
            problems = compare(p, host_all(run_ranks(p, call, train)))
            if problems:
                raise Mismatch("\n".join(problems))
        return check
    return [Check(f"p={p}: {label}", make(p), hint) for p in sizes]


def run_report(name, train, p, compare, describe=None, call=_call):
    """``run NAME``: the program on ThreadWorld(p); prints what minitrain reports and returns 0 if it
    now behaves (finishes, equals one process), 1 otherwise."""
    print(f"{name}: running train(comm) on ThreadWorld({p}); a rank waiting more than {rank_wait():g} s "
          "for a message counts as stuck\n")
    try:
        results = host_all(run_ranks(p, call, train))
    except (RanksFailed, StopGrading) as e:
        print("minitrain reports:\n")
        print("\n".join("  " + line for line in str(e).splitlines()))
        print(f"\nFind the bug, fix it in your copy (python -m minitrain.exercises stub {name} mine.py), then "
              f"python -m minitrain.exercises check {name} mine.py")
        return 1
    except Exception as e:                     # the program crashed on its own: show where
        from .grading import explain
        print(explain(e))
        return 1
    if describe:
        print(describe(p, results))
    problems = compare(p, results)
    if problems:
        print("compared with one process on the same global batch:\n")
        print("\n".join("  " + line for line in problems))
        print(f"\nFind the bug, fix it in your copy (python -m minitrain.exercises stub {name} mine.py), then "
              f"python -m minitrain.exercises check {name} mine.py")
        return 1
    print(f"It finishes and equals one process at p = {p}. Grade it: python -m minitrain.exercises check {name} PATH")
    return 0


def under_mpi():
    """True when this process was started by mpiexec with more than one rank."""
    for variable in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(variable, "1") not in ("", "1"):
            return True
    return False


def main(train, name):
    """The broken program's ``if __name__ == "__main__":`` entry."""
    if under_mpi():
        comm = mpi_world(timeout=10.0)
        result = train(comm)
        print(f"[rank {comm.rank}] train returned {summary(result)}", flush=True)
        raise SystemExit(0)
    from .registry import get
    raise SystemExit(get(name).run(train, None))


def summary(result):
    import numpy as np
    if isinstance(result, tuple):
        return "(" + ", ".join(summary(r) for r in result) + ")"
    if isinstance(result, np.ndarray):
        return f"array{result.shape}"
    if isinstance(result, list):
        return f"list of {len(result)}"
    return repr(result)


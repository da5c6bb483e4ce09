"""``python -m minitrain.exercises {list, stub NAME DEST, check NAME PATH [--reference]}``."""
import argparse
import importlib.util
import pathlib
import shutil
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
EXERCISES = {
    "ring_all_reduce": "the ring all-reduce on point-to-point calls (notebook 02_collectives)",
}


def load_function(path, name):
    spec = importlib.util.spec_from_file_location(f"exercise_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{path} defines no function {name}()")
    return getattr(module, name)


def check_ring_all_reduce(impl):
    """The library's collective checks, plus the ring's bandwidth bound, at p = 1..4."""
    from minitrain.comm import ThreadWorld
    from minitrain.testing import check_all_reduce

    results = []

    def bandwidth(comm):
        n = 1200
        before = comm.stats.bytes_sent
        impl(comm, np.ones(n, np.float32), op="sum")
        sent = comm.stats.bytes_sent - before
        bound = 2 * (comm.size - 1) * -(-n // comm.size) * 4
        assert sent <= bound, (f"[rank {comm.rank}] sent {sent} bytes for {n} float32 at p={comm.size}: "
                               f"a ring sends at most 2(p-1)·ceil(N/p)·4 = {bound}")

    for p in (1, 2, 3, 4):
        for label, fn in (("exact on every length, dtype and op", lambda c: check_all_reduce(c, impl)),
                          ("bytes sent within the ring's bound", bandwidth)):
            try:
                ThreadWorld(p, timeout=20).run(fn)
                results.append((f"p={p}: {label}", None))
            except BaseException as e:   # the learner's code may raise anything
                results.append((f"p={p}: {label}", e))
    return results


CHECKS = {"ring_all_reduce": check_ring_all_reduce}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minitrain.exercises", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    stub = sub.add_parser("stub")
    stub.add_argument("name", choices=sorted(EXERCISES))
    stub.add_argument("dest")
    check = sub.add_parser("check")
    check.add_argument("name", choices=sorted(EXERCISES))
    check.add_argument("path", nargs="?")
    check.add_argument("--reference", action="store_true", help="grade minitrain's own implementation")
    args = ap.parse_args(argv)

    if args.command == "list":
        for name, what in EXERCISES.items():
            print(f"{name:<20} {what}  (stub: {HERE / (name + '_stub.py')})")
        return 0
    if args.command == "stub":
        shutil.copy(HERE / f"{args.name}_stub.py", args.dest)
        print(f"wrote {args.dest}; then: python -m minitrain.exercises check {args.name} {args.dest}")
        return 0
    if args.reference:
        from minitrain import comm as library
        impl = getattr(library, args.name)
    elif args.path:
        impl = load_function(args.path, args.name)
    else:
        ap.error("check needs PATH (or --reference)")
    results = CHECKS[args.name](impl)
    failed = 0
    for label, error in results:
        if error is None:
            print(f"  PASS  {label}")
        else:
            failed += 1
            first = (str(error).splitlines() or [""])[0]
            notes = "; ".join(getattr(error, "__notes__", []))
            print(f"  FAIL  {label}\n        {type(error).__name__}: {first}" + (f" ({notes})" if notes else ""))
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

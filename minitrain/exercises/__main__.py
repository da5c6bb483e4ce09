"""The exercises' command line: list, show, hint, stub, check, run (see python -m minitrain.exercises -h)."""
import argparse
import functools
import sys
import textwrap

from .. import cli
from . import harness
from .grading import LoadError
from .isolation import grade_in_child
from .progress import Progress, default_path
from .registry import UnknownExercise, all_exercises, get, names

DESCRIPTION = """\
Exercises graded by minitrain's own tests. Start with list, read an exercise with show, copy its
stub with stub, write the code, then check it; hint shows one hint at a time.

  python -m minitrain.exercises list
  python -m minitrain.exercises show ring_all_reduce
  python -m minitrain.exercises stub ring_all_reduce mine.py
  python -m minitrain.exercises check ring_all_reduce mine.py
  python -m minitrain.exercises hint ring_all_reduce          (the next unread hint)
  python -m minitrain.exercises run debug_hanging_loop        (debugging exercises: see the bug)

Progress (what passed, hints read) is kept in a JSON file: $MINITRAIN_EXERCISES_PROGRESS, else
$XDG_CACHE_HOME/minitrain/exercises.json, else ~/.cache/minitrain/exercises.json."""


def _wrap(text, indent="  ", width=100, hang=4):
    """Wrap each line at ``width``, keeping its own indentation (continuations indented ``hang`` more)."""
    out = []
    for line in text.split("\n"):
        lead = " " * (len(line) - len(line.lstrip(" ")))
        out.extend(textwrap.wrap(line.strip(), width, initial_indent=indent + lead,
                                 subsequent_indent=indent + lead + " " * hang, break_on_hyphens=False) or [""])
    return "\n".join(out)


def cmd_list(args, progress):
    rows = all_exercises()
    done = 0
    print(f"{'':3} {'exercise':<30} {'kind':<10} {'status':<8} {'hints':<6} what")
    for i, e in enumerate(rows, 1):
        state = progress.get(e.name)
        status = "passed" if state.get("passed") else ("tried" if state.get("attempts") else "-")
        done += bool(state.get("passed"))
        hints = f"{state.get('hints_read', 0)}/{len(e.hints)}"
        note = f" (notebook {e.notebook})" if e.notebook else ""
        print(f"{i:>2}. {e.name:<30} {e.kind:<10} {status:<8} {hints:<6} {e.title}{note}")
    print(f"\n{done} of {len(rows)} passed (progress: {progress.path})")
    return 0


def cmd_show(args, progress):
    e = get(args.name)
    print(f"{e.name}: {e.title}")
    print(f"kind: {e.kind}" + (f"; walkthrough: notebooks/{e.notebook}.ipynb" if e.notebook else ""))
    print()
    print(_wrap(e.intro(), ""))
    print("\nYou fix:" if e.kind == "debug" else "\nYou write:")
    for line in e.signatures():
        print(f"    {line}")
    print("\nThe grader's checks:")
    for check in e.checks():
        print(f"  - {check.label}")
    print(f"\nStart:  python -m minitrain.exercises stub {e.name} mine.py")
    if e.kind == "debug":
        print(f"Run it: python -m minitrain.exercises run {e.name} [mine.py]")
    print(f"Check:  python -m minitrain.exercises check {e.name} mine.py")
    read = progress.get(e.name).get("hints_read", 0)
    print(f"Hints:  {len(e.hints)} levels, {read} read (python -m minitrain.exercises hint {e.name})")
    return 0


def cmd_hint(args, progress):
    e = get(args.name)
    total = len(e.hints)
    read = progress.get(e.name).get("hints_read", 0)
    if args.all:
        levels = list(range(1, total + 1))
    elif args.level is not None:
        if not 1 <= args.level <= total:
            print(f"{e.name} has hints 1 to {total}; there is no hint {args.level}", file=sys.stderr)
            return 2
        levels = [args.level]
    else:
        levels = [min(read + 1, total)]
    for level in levels:
        print(f"Hint {level} of {total} ({e.name}):")
        print(_wrap(e.hints[level - 1], hang=0))
        print()
    if not args.all and levels[-1] < total:
        print(f"Next: python -m minitrain.exercises hint {e.name}   (hint {levels[-1] + 1} of {total})")
    elif not args.all and args.level is None and read >= total:
        print("That was the last hint.")
    warning = progress.record_hint(e.name, max(levels))
    if warning:
        print(f"note: {warning}", file=sys.stderr)
    return 0


def cmd_stub(args, progress):
    import pathlib
    e = get(args.name)
    dest = pathlib.Path(args.dest)
    if dest.is_dir():                    # as cp does: into the folder, under the exercise's name
        dest = dest / f"{e.name}.py"
    if dest.exists() and not args.force:
        print(f"{dest} exists; not overwriting it (pass --force to replace it)", file=sys.stderr)
        return 2
    try:
        dest.write_text(e.stub)
    except OSError as err:
        print(f"cannot write {dest}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {dest}; then: python -m minitrain.exercises check {e.name} {dest}")
    return 0


def _load(e, args):
    return e.reference() if args.reference else e.load(args.path)


def cmd_check(args, progress):
    e = get(args.name)
    what = "minitrain's own implementation" if args.reference else args.path
    try:
        if not args.reference and not args.path:
            raise LoadError("give the path of your file (or --reference to grade minitrain's own implementation)")
        results = grade_in_child(e, lambda: _load(e, args), fail_fast=args.fail_fast)
    except LoadError as err:
        print(f"check {e.name}: {err}", file=sys.stderr)
        if args.path and not args.reference:
            progress.record_check(e.name, False, args.path)
        return 2
    print(f"check {e.name}: {what}\n")
    failed = [r for r in results if r.status == "fail"]
    previous = None
    for r in results:
        print(f"  {r.status.upper():<5} {r.label}")
        if r.status != "pass" and r.explanation:
            same = r.explanation == previous
            print(_wrap("(the same as above)" if same else r.explanation, "        "))
            previous = r.explanation
        if r.status == "fail" and r.hint:
            print(f"        Read hint {r.hint}: python -m minitrain.exercises hint {e.name} --level {r.hint}")
    passed = sum(r.status == "pass" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    print(f"\n{passed} passed, {len(failed)} failed" + (f", {skipped} skipped" if skipped else ""))
    if not args.reference:
        warning = progress.record_check(e.name, not failed, args.path)
        if warning:
            print(f"note: {warning}", file=sys.stderr)
    if failed:
        first = min(r.hint for r in failed if r.hint) if any(r.hint for r in failed) else None
        if first:
            print(f"Not yet. Start with hint {first}: python -m minitrain.exercises hint {e.name} --level {first}")
        return 1
    if args.reference:
        print("minitrain's own implementation passes every check.")
        return 0
    order = names()
    following = order[order.index(e.name) + 1] if order.index(e.name) + 1 < len(order) else None
    print(f"{e.name} is done." + (f" Next: python -m minitrain.exercises show {following}" if following else ""))
    return 0


def cmd_run(args, progress):
    e = get(args.name)
    if e.kind != "debug":
        print(f"{e.name} is not a debugging exercise; run is for those "
              f"({', '.join(x.name for x in all_exercises() if x.kind == 'debug')})", file=sys.stderr)
        return 2
    try:
        impl = e.load(args.path) if args.path else e.module.broken()
    except LoadError as err:
        print(f"run {e.name}: {err}", file=sys.stderr)
        return 2
    return e.run(impl, args.p)


NAME_HELP = "an exercise's name (python -m minitrain.exercises list shows them)"


def _progress_path(text):
    """--progress: a path; an empty one (an unset shell variable) is refused rather than read as the default."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (leave --progress out for the default)")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minitrain.exercises", description=DESCRIPTION,
                                 formatter_class=cli.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--progress", metavar="PATH", default=None, type=_progress_path,
                    help=f"the progress file (default: {default_path()})")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                         parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    plain = {"formatter_class": cli.HelpFormatter}
    sub.add_parser("list", help="every exercise, in learning-path order, with what passed", **plain)
    p = sub.add_parser("show", help="the exercise's text: contract, signature, the grader's checks", **plain)
    p.add_argument("name", metavar="NAME", help=NAME_HELP)
    p = sub.add_parser("hint", help="the next unread hint (or --level K, or --all)", **plain)
    p.add_argument("name", metavar="NAME", help=NAME_HELP)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--level", type=cli.positive_int, metavar="K",
                       help="show hint K, 1 the gentlest (default: the next unread one)")
    group.add_argument("--all", action="store_true", help="show every hint")
    p = sub.add_parser("stub", help="write the exercise's starting file to DEST", **plain)
    p.add_argument("name", metavar="NAME", help=NAME_HELP)
    p.add_argument("dest", metavar="DEST", help="where to write it, e.g. mine.py (a folder: NAME.py in it)")
    p.add_argument("--force", action="store_true", help="overwrite DEST if it exists (default: refuse)")
    commands = {}
    for command, text, path_help in (("check", "grade your file with the library's own tests",
                                      "your file (no default: required unless --reference)"),
                                     ("run", "debugging exercises: run the program (the broken one by default) "
                                             "and show what minitrain reports",
                                      "your fixed copy (default: the broken program)")):
        p = commands[command] = sub.add_parser(command, help=text, **plain)
        p.add_argument("name", metavar="NAME", help=NAME_HELP)
        p.add_argument("path", metavar="PATH", nargs="?", help=path_help)
        p.add_argument("--timeout", type=cli.wait_seconds, default=harness.DEFAULT_WAIT_TIMEOUT, metavar="S",
                       help="seconds a rank may wait for a message before it counts as stuck (a world of "
                            f"ranks may run {harness.WALL_FACTOR}S + {harness.WALL_EXTRA_S:g} s in all; on the GPU "
                            f"each wait {harness.GPU_EXTRA_S:g} s more, for CuPy's first compiles)")
        if command == "check":
            p.add_argument("--reference", action="store_true",
                           help="grade minitrain's own implementation instead of a file")
            p.add_argument("--fail-fast", action="store_true", help="stop at the first failed check")
        else:
            p.add_argument("-p", type=cli.positive_int, default=None, metavar="N", help="number of ranks (default: the exercise's)")
    args = ap.parse_args(argv)
    if getattr(args, "reference", False) and args.path:
        cli.refuse(commands["check"], "--reference", "PATH", "it grades minitrain's own implementation, not a file")
    progress = Progress(args.progress)
    if progress.warning:
        print(f"note: {progress.warning}", file=sys.stderr)
    if getattr(args, "timeout", None) is not None:
        harness.set_wait_timeout(args.timeout)
    args.reference = getattr(args, "reference", False)
    args.fail_fast = getattr(args, "fail_fast", False)
    run = {"list": cmd_list, "show": cmd_show, "hint": cmd_hint, "stub": cmd_stub, "check": cmd_check, "run": cmd_run}
    try:
        return run[args.command](args, progress)
    except UnknownExercise as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    cli.run_command(main)

"""python -m minitrain.checkpoint inspect DIR: the manifest as a table (tensors, shapes, dtypes,
pieces, bytes; layout, step, files). verify DIR reads every piece and checks its CRC-32.
list DIR: every checkpoint in DIR, oldest first, one whose rank files are missing or of another size
marked incomplete. DIR may be a save directory (its newest checkpoint is shown) or one checkpoint.
A save still being written (or interrupted) is a .tmp-step-* folder with no manifest: named, never read.
Exit status 1 where DIR holds no complete checkpoint, 2 where DIR is not there, cannot be read or a
checkpoint is damaged."""
import argparse
import os
import sys

from .. import cli
from .core import Reader
from .manifest import (MANIFEST, TMP_PREFIX, damaged_step_folders, describe, file_problems, latest, list_checkpoints,
                       read_manifest, step_folders, unfinished_saves)
from .storage import CheckpointError


def verify(path):
    """Read every piece of the checkpoint in ``path`` and check it; returns (pieces, bytes)."""
    manifest = read_manifest(path)
    reader = Reader(path, manifest)
    pieces = nbytes = 0
    try:
        for spec in manifest["tensors"].values():
            for piece in spec["pieces"]:
                reader._piece(spec, piece)
                pieces += 1
                nbytes += piece["data_offsets"][1] - piece["data_offsets"][0]
    finally:
        reader.close()
    return pieces, nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minitrain.checkpoint", description=__doc__.split("\n\n")[0],
                                     formatter_class=cli.HelpFormatter, allow_abbrev=False)
    parser.add_argument("command", choices=["inspect", "verify", "list"],
                        help="inspect: the manifest as a table; verify: read every piece and check its CRC-32; "
                             "list: every checkpoint, oldest first (incomplete ones marked)")
    parser.add_argument("directory", metavar="DIR", help="a save directory (its newest checkpoint) or one checkpoint")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        what = "a file, not a directory" if os.path.exists(args.directory) else "no such directory"
        print(f"error: {args.directory}: {what}", file=sys.stderr)
        return 2
    try:
        return _run(args.command, args.directory)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:                       # a reader that stopped reading: cli.run_command's to end
        raise
    except OSError as e:                          # a folder it may not list, a file it may not read
        print(f"error: cannot read {e.filename or args.directory}: {e.strerror or e}", file=sys.stderr)
        return 2


def _none_complete(directory):
    """The line for a directory with no complete checkpoint, naming the saves still being written there."""
    if os.path.basename(os.path.normpath(directory)).startswith(TMP_PREFIX):
        return f"{directory} is a save still being written, or interrupted: it has no {MANIFEST} yet"
    unfinished = unfinished_saves(directory)
    line = f"no complete checkpoint in {directory}" + (
        f" ({', '.join(unfinished)}: a save still being written, or interrupted)" if unfinished else "")
    inside = [name for name in sorted(os.listdir(directory)) if os.path.isdir(os.path.join(directory, name))
              and (os.path.exists(os.path.join(directory, name, MANIFEST)) or step_folders(os.path.join(directory, name)))]
    if inside:                                    # the folder above the save directories
        line += f"; the folders in it that hold checkpoints: {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}"
    return line


def _run(command, directory):
    if command == "list":
        unreadable = []
        if os.path.exists(os.path.join(directory, MANIFEST)):             # one checkpoint itself
            manifest = read_manifest(directory)
            found = [(int(manifest["step"]), manifest["created"], directory)]
        else:
            found = list_checkpoints(directory, unreadable)
            for path, error in unreadable:
                print(f"damaged: {path}: {error}", file=sys.stderr)
        damaged = bool(unreadable)
        for step, _, path in found:
            problems = file_problems(path)
            print(f"step {step:>8}  {path}" + (f"  (incomplete: {'; '.join(problems)})" if problems else ""))
            damaged = damaged or bool(problems)
        for name in damaged_step_folders(directory):
            print(f"damaged: {os.path.join(directory, name)} has no manifest.json", file=sys.stderr)
            damaged = True
        if found:
            for name in unfinished_saves(directory):
                print(f"unfinished: {os.path.join(directory, name)} (a save still being written, or interrupted: not "
                      f"a checkpoint)", file=sys.stderr)
        else:
            print(_none_complete(directory), file=sys.stderr)
        return 2 if damaged else 0 if found else 1
    path = latest(directory)
    if path is None:
        print(_none_complete(directory), file=sys.stderr)
        return 1
    if command == "inspect":
        if os.path.abspath(path) != os.path.abspath(directory):
            print(f"(the newest of {len(list_checkpoints(directory))} checkpoint(s) in {directory})")
        print(describe(path))
        problems = file_problems(path)
        if problems:
            print(f"error: {path} is incomplete: {'; '.join(problems)}", file=sys.stderr)
            return 2
    else:
        pieces, nbytes = verify(path)
        print(f"{path}: {pieces} pieces, {nbytes:,} bytes: every checksum matches")
    return 0


if __name__ == "__main__":
    cli.run_command(main)

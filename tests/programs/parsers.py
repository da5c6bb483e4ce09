"""Every command line of minitrain's jobs, tools and benchmarks, as its parser renders it: each
program runs until it calls parse_args, which is stopped there (nothing else runs), and the parser
and its subcommands are printed as JSON lines: {"prog", "option", "help"} per option, where help is
the text --help shows (defaults expanded), plus {"prog", "description"} per parser. Run by
tests/test_cli.py in a subprocess (the scripts import MPI and GPU modules at will)."""
import argparse
import contextlib
import importlib
import io
import json
import pathlib
import runpy
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = {   # module -> the function that builds and parses its command line
    "minitrain.examples.mlp": "main", "minitrain.examples.gpt": "main", "minitrain.examples.generate": "main",
    "minitrain.plan.__main__": "main", "minitrain.plan.calibrate": "main", "minitrain.plan.validate": "main",
    "minitrain.checkpoint.__main__": "main", "minitrain.exercises.__main__": "main",
}


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _capture(self, args=None, namespace=None):
    raise Captured(self)


def _rows(parser, source):
    yield {"source": source, "prog": parser.prog, "description": parser.description or ""}
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield {"source": source, "prog": parser.prog, "option": choice.dest, "help": choice.help or "",
                       "subcommand": True}
            for sub in dict.fromkeys(action.choices.values()):
                if sub.add_help:                 # add_help=False: the subcommand parses with its own parser
                    yield from _rows(sub, source)
            continue
        name = "/".join(action.option_strings) or action.dest
        text = formatter._expand_help(action) if action.help else ""
        yield {"source": source, "prog": parser.prog, "option": name, "help": text, "required": action.required,
               "positional": not action.option_strings, "default": repr(action.default)}


def parsers():
    argparse.ArgumentParser.parse_args = _capture
    argparse.ArgumentParser.parse_known_args = _capture
    programs = [(m, lambda m=m: getattr(importlib.import_module(m), MODULES[m])([])) for m in MODULES]
    for path in sorted((ROOT / "scripts").glob("*.py")):
        if "add_argument" in path.read_text():
            programs.append((f"scripts/{path.name}", lambda path=path: runpy.run_path(str(path), run_name="__main__")))
    for source, run in programs:
        sys.argv = [source]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run()
        except Captured as c:
            yield from _rows(c.parser, source)
        else:
            yield {"source": source, "error": "never called parse_args"}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    for row in parsers():
        print(json.dumps(row))

"""Command lines and docstrings read as plain text: every option of every job, tool and benchmark
has help text that shows its default (tests/programs/parsers.py captures each parser at
parse_args, in one subprocess), and no module docstring, description or help text carries
reStructuredText markup (double backticks, :func: roles, bold, directives)."""
import ast
import contextlib
import io
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKUP = re.compile(r"``|:(func|class|meth|mod|ref|attr|data|exc|obj):`|^\s*\.\. \w+::|\*\*[A-Za-z][^*\n]*\*\*", re.M)
PROGRAMS = ["minitrain.examples.mlp", "minitrain.examples.gpt", "minitrain.examples.generate", "minitrain.plan.__main__",
            "minitrain.plan.calibrate", "minitrain.plan.validate", "minitrain.checkpoint.__main__",
            "minitrain.exercises.__main__"]


@pytest.fixture(scope="module")
def options():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "programs" / "parsers.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_every_program_s_parser_is_walked(options):
    assert not [row for row in options if "error" in row]
    sources = {row["source"] for row in options}
    scripts = {f"scripts/{p.name}" for p in (ROOT / "scripts").glob("*.py") if "add_argument" in p.read_text()}
    assert set(PROGRAMS) | scripts <= sources and len(scripts) >= 10
    progs = {row["prog"] for row in options if row["source"] == "minitrain.plan.__main__"}
    assert {"python -m minitrain.plan mlp", "python -m minitrain.plan gpt", "python -m minitrain.plan params"} <= progs


def test_every_option_has_help_that_shows_its_default(options):
    missing = []
    for row in options:
        if "option" not in row or row.get("subcommand"):
            continue
        needs_default = not row["required"] and not (row["positional"] and row["default"] == "None")
        if not row["help"].strip() or (needs_default and "default" not in row["help"]):
            missing.append(f"{row['prog']} {row['option']}: {row['help']!r}")
    assert not missing, "options without help or without their default:\n" + "\n".join(missing)


def test_every_option_a_help_text_names_is_one_its_command_takes(options):
    """A help text that names an option (--steps) names one of its own command's, not another job's."""
    taken = {}
    for row in options:
        if "option" in row and not row.get("subcommand"):
            taken.setdefault(row["prog"], set()).update(row["option"].split("/"))
    foreign = [f"{row['prog']} {row['option']}: {name}" for row in options
               if "option" in row and not row.get("subcommand")
               for name in sorted(set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", row["help"])) - taken[row["prog"]])]
    assert not foreign, foreign


def test_help_and_descriptions_are_plain_text(options):
    marked = [f"{row['prog']} {row.get('option', '(description)')}" for row in options
              if MARKUP.search(row.get("help", "") + row.get("description", ""))]
    assert not marked, marked


@pytest.mark.parametrize("folder", ["minitrain", "scripts"])
def test_module_docstrings_are_plain_text(folder):
    marked = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc and MARKUP.search(doc):
            marked.append(f"{path.relative_to(ROOT)}: {MARKUP.search(doc).group(0)!r}")
    assert not marked, "reStructuredText markup in module docstrings (--help and show print them):\n" + "\n".join(marked)


def test_help_prints_the_defaults():
    from minitrain.examples.mlp import parse_args
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(out.getvalue().split())
    assert "--epochs EPOCHS passes over the training set (default: 30)" in text
    assert "--no-progress no progress bar (default: off)" in text and "(default: no limit)" in text
    assert "(default: None)" not in text


@pytest.mark.parametrize("argv", [["minitrain.exercises", "hint", "ring_all_reduce", "--all"],
                                  ["minitrain.plan", "gpt", "--n-layer", "2"]])
def test_a_reader_that_stops_reading_ends_the_command_quietly(argv):
    """`... | head -1`: the reader closes the pipe before the command writes; the command ends with
    status 141 (a Unix tool killed by SIGPIPE) and no BrokenPipeError traceback on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    proc.stdout.close()                    # before the interpreter has started: every write meets a closed pipe
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 141

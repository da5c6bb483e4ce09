"""Every option honoured or refused, every value checked before any work: each command line's parsers
(the jobs, the planner and its sub-commands, the checkpoint tool, the exercises) are captured at
parse_args, every numeric option is given values out of its range and must stop the command with
argparse's one error line and exit status 2 (no traceback, nothing run); the option combinations a
job would silently ignore are refused by name; --lr 0 trains at rate 0; and the GPT job's dropout
under --tp draws one process's masks, as its docstring claims (float64, the losses within 1e-10)."""
import argparse
import contextlib
import importlib
import io
import json
import pathlib
import sys

import numpy as np
import pytest

from minitrain import checkpoint, cli, nn
from minitrain.examples import gpt, mlp
from minitrain.plan.__main__ import _json_path as plan_json_path
from minitrain.testing import run_mpi

PROGRAMS = {"minitrain.examples.mlp": [], "minitrain.examples.gpt": [], "minitrain.examples.generate": [],
            "minitrain.plan.__main__": ["mlp"], "minitrain.checkpoint.__main__": ["list", "."],
            "minitrain.exercises.__main__": ["hint", "x"], "minitrain.plan.calibrate": []}
#: per validated type: values it must refuse
OUT_OF_RANGE = {cli.positive_int: ["0", "-3", "1.5", "x"], cli.nonneg_int: ["-1", "x"],
                cli.positive_float: ["0", "-1", "nan", "inf"], cli.nonneg_float: ["-1", "nan"],
                cli.wait_seconds: ["0", "-1", "nan", "1e300"],      # 1e300: a deadline the clock cannot hold
                cli.probability: ["1.0", "1.5", "-0.1"],
                cli.comm_timeout: ["0.001", "0", "-1", "nan", "inf", "1e300"],   # below 1 s: a slower rank read as
                # hung; above 1e9 s: a hard timeout the clock cannot hold
                cli.output_file: [".", "no-such-folder/out.json"]}   # a file written at the end: a folder, none


class Captured(Exception):
    pass


def _parsers():
    """(module, the argv prefix that reaches a sub-parser, the parser) for every parser of every program."""
    found = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise Captured(self)
    argparse.ArgumentParser.parse_args = capture
    try:
        for module, _ in PROGRAMS.items():
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    importlib.import_module(module).main([])
            except Captured as c:
                top = c.args[0]
            found.append((module, [], top))
            for action in top._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for name, sub in action.choices.items():
                        if sub.add_help:
                            found.append((module, [name], sub))
    finally:
        argparse.ArgumentParser.parse_args = real
    return found


PARSERS = _parsers()


def _numeric_options():
    cases = []
    for module, prefix, parser in PARSERS:
        for action in parser._actions:
            for value in OUT_OF_RANGE.get(action.type, []):
                cases.append(pytest.param(module, prefix, parser, action.option_strings[0], value,
                                          id=f"{module.split('.')[-2 if module.endswith('__main__') else -1]}"
                                             f"{'-' + prefix[0] if prefix else ''} {action.option_strings[0]} {value}"))
    return cases


def test_every_number_a_command_line_takes_is_checked_while_parsing():
    raw = [(module, parser.prog, action.option_strings) for module, _, parser in PARSERS for action in parser._actions
           if action.type in (int, float) and not action.choices]
    assert not raw, f"options typed int/float without a range: {raw}"
    assert len(_numeric_options()) > 150


def _run(module, argv):
    """The program's main on argv: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = importlib.import_module(module).main(argv)
        except SystemExit as e:
            status = e.code
    return status, err.getvalue()


@pytest.mark.parametrize("module, prefix, parser, option, value", _numeric_options())
def test_a_value_out_of_range_stops_with_one_argparse_line(module, prefix, parser, option, value):
    required = [a for a in parser._actions if a.required and a.option_strings and a.option_strings[0] != option]
    argv = prefix + [x for a in required for x in (a.option_strings[0], "1")] + [option, value]
    status, err = _run(module, argv)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert status == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and f"error: argument {option}" in errors[0], err


PATHS = {cli.output_file: ["{missing}/out.json", "{folder}", "{folder}/new/"],      # new/: a folder's name
         plan_json_path: ["{missing}/plan.json", "{folder}"],
         cli.output_image: ["{missing}/step.png", "{folder}/step.xyz"], cli.output_folder: ["{file}", "{file}/ckpt"]}


def _path_options():
    return [pytest.param(module, prefix, action.option_strings[0], value,
                         id=f"{parser.prog} {action.option_strings[0]} {value}")
            for module, prefix, parser in PARSERS for action in parser._actions for value in PATHS.get(action.type, [])]


@pytest.mark.parametrize("module, prefix, option, value", _path_options())
def test_a_path_the_run_could_not_write_stops_it_before_any_work(tmp_path, module, prefix, option, value):
    """--json, --trace, --plot, --save-dir: written when the run ends, so checked while parsing (a missing
    folder, a folder given for a file, a format matplotlib does not write, a file given for a folder)."""
    (tmp_path / "a-file").write_text("")
    path = value.format(missing=tmp_path / "missing", folder=tmp_path, file=tmp_path / "a-file")
    status, err = _run(module, prefix + [option, path])
    errors = [line for line in err.splitlines() if "error:" in line]
    assert status == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and f"error: argument {option}: " in errors[0], err


def test_every_path_a_command_line_writes_is_checked_while_parsing():
    options = {(module.split(".")[-1], *prefix, action.option_strings[0]) for module, prefix, parser in PARSERS
               for action in parser._actions if action.type in PATHS}
    assert options == {("mlp", "--json"), ("mlp", "--trace"), ("mlp", "--plot"), ("mlp", "--save-dir"),
                       ("gpt", "--json"), ("gpt", "--save-dir"), ("generate", "--json"),
                       ("__main__", "mlp", "--json"), ("__main__", "gpt", "--json"), ("__main__", "params", "--json"),
                       ("calibrate", "--out")}
    assert cli.output_folder(str(pathlib.Path(__file__).parent / "new" / "nested"))     # made when saved


def test_a_list_option_refuses_a_value_given_twice(tmp_path, monkeypatch):
    """calibrate --ranks 2 2 measured p = 2 twice; validate --runs ddp-2 ddp-2 would run it twice (cli.Distinct)."""
    from minitrain.plan import calibrate, validate
    monkeypatch.setattr(calibrate, "calibrate", lambda *a: pytest.fail("calibrate measured"))
    monkeypatch.setattr(validate, "run", lambda *a, **k: pytest.fail("validate ran a job"))
    monkeypatch.setattr(calibrate, "DEFAULT_PATH", tmp_path / "machine.json")
    lists = {(parser.prog, action.option_strings[0]): action for _, _, parser in PARSERS for action in parser._actions
             if action.nargs in ("+", "*") and action.option_strings and action.help != argparse.SUPPRESS}
    assert {key for key, action in lists.items() if not isinstance(action, cli.Distinct)} == {
        ("python -m minitrain.plan calibrate", "--merge")}           # the best of A and A is A: harmless
    status, err = _run("minitrain.plan.calibrate", ["--ranks", "2", "3", "3"])
    assert status == 2 and "error: argument --ranks: 3 given more than once (each value runs once)" in err, err
    status, err = _run("minitrain.plan.validate", ["--runs", *[next(iter(validate.RUNS))] * 2])
    assert status == 2 and "error: argument --runs: " in err and "given more than once" in err, err


REFUSED = [  # (module, argv, the option refused, the setting it is refused with)
    ("mlp", ["--strategy", "pipeline", "--recompute", "full"], "--recompute", "--strategy pipeline"),
    ("mlp", ["--strategy", "pipeline", "--offload"], "--offload", "--strategy pipeline"),
    ("mlp", ["--strategy", "pipeline", "--offload-activations"], "--offload-activations", "--strategy pipeline"),
    ("mlp", ["--strategy", "pipeline", "--device-memory", "100000"], "--device-memory", "--strategy pipeline"),
    ("mlp", ["--strategy", "pipeline", "--precision", "bf16"], "--precision", "--strategy pipeline"),
    ("mlp", ["--dp", "2"], "--dp", "--strategy ddp"),
    ("mlp", ["--strategy", "zero3", "--microbatches", "8"], "--microbatches", "--strategy zero3"),
    ("mlp", ["--schedule", "gpipe"], "--schedule", "--strategy ddp"),
    ("mlp", ["--strategy", "zero1", "--sync-every", "2"], "--sync-every", "--strategy zero1"),
    ("mlp", ["--strategy", "zero3", "--bucket-cap-mb", "1"], "--bucket-cap-mb", "--strategy zero3"),
    ("gpt", ["--schedule", "gpipe"], "--schedule", "--pp 1"),
    ("gpt", ["--chunks", "2", "--schedule", "interleaved_1f1b"], "--schedule", "--pp 1"),
    ("gpt", ["--precision", "bf16", "--init-scale", "1024"], "--init-scale", "--precision bf16"),
    ("generate", ["--checkpoint", "DIR", "--train-steps", "5"], "--train-steps", "--checkpoint"),
    ("generate", ["--checkpoint", "DIR", "--lr", "1e-3"], "--lr", "--checkpoint"),
    ("generate", ["--top-k", "5"], "--top-k", "--temperature 0"),
    ("generate", ["--cache", "contiguous", "--preempt", "recompute"], "--preempt", "--cache contiguous"),
    ("generate", ["--cache", "none", "--block-size", "8"], "--block-size", "--cache none"),
    ("generate", ["--preempt", "recompute"], "--preempt", "no --device-memory"),
]


@pytest.mark.parametrize("job, argv, option, setting", REFUSED, ids=[" ".join(r[1]) for r in REFUSED])
def test_an_option_the_job_would_ignore_is_refused_by_name(job, argv, option, setting):
    status, err = _run(f"minitrain.examples.{job}", argv)
    assert status == 2 and "Traceback" not in err, err
    assert f"error: {option} is not supported with {setting} (" in err, err


def test_the_options_each_strategy_applies_are_accepted():
    for argv in (["--strategy", "pipeline", "--dp", "1", "--microbatches", "2", "--schedule", "gpipe"],
                 ["--strategy", "local_sgd", "--sync-every", "2"], ["--strategy", "zero2", "--bucket-cap-mb", "1"],
                 ["--strategy", "zero3", "--recompute", "full", "--offload", "--device-memory", "10000000"]):
        mlp.parse_args(argv)
    gpt.parse_args(["--pp", "2", "--schedule", "gpipe"])


def test_the_block_size_must_fit_the_corpus():
    status, err = _run("minitrain.examples.gpt", ["--block-size", "100000"])
    assert status == 2 and "error: argument --block-size: must be at most" in err and "Traceback" not in err


def test_the_batch_must_fit_the_training_split():
    """A batch bigger than the data would be the whole split each step, not the size asked for."""
    status, err = _run("minitrain.examples.mlp", ["--batch-size", "1439", "--strategy", "pipeline"])
    assert status == 2 and "Traceback" not in err, err
    assert "error: argument --batch-size: must be at most 1438 (the digits' training split has 1438 samples), " \
           "got 1439" in err, err
    assert mlp.parse_args(["--batch-size", "1438"])[0].batch_size == 1438


def _model_at(path):
    model = nn.MLP([64, 32, 32, 10])
    checkpoint.load(path, None, model, strict=False)
    return [q.data.copy() for q in model.parameters()]


@pytest.mark.parametrize("lr, moves", [("0", False), ("1e-3", True)])
def test_lr_0_is_honoured(tmp_path, lr, moves):
    d = tmp_path / "ckpt"
    assert mlp.main(["--no-progress", "--precision", "fp64", "--hidden", "32", "--epochs", "1", "--batch-size", "512",
                     "--lr", lr, "--save-dir", str(d), "--save-every", "1"]) == 0
    (first, _, one), *_, (last, _, end) = checkpoint.list_checkpoints(d)
    assert last > first
    same = all(np.array_equal(a, b) for a, b in zip(_model_at(one), _model_at(end)))
    assert same != moves


GPT = ["--no-progress", "--precision", "fp64", "--steps", "3", "--n-embd", "32", "--block-size", "16",
       "--batch-size", "4", "--sample-chars", "1", "--dropout", "0.1"]


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"]], ids=["tp2", "tp2+sp"])
def test_gpt_job_under_tp_2_with_dropout_draws_one_process_s_masks(tmp_path, extra):
    assert gpt.main(GPT + ["--json", str(tmp_path / "one.json")]) == 0
    run_mpi([sys.executable, "-m", "minitrain.examples.gpt", *GPT, "--tp", "2", *extra,
             "--json", tmp_path / "tp.json"], n=2, timeout=180)
    one, tp = (json.loads((tmp_path / f"{n}.json").read_text())["losses"] for n in ("one", "tp"))
    assert len(one) == len(tp) == 3
    assert max(abs(a - b) for a, b in zip(one, tp)) <= 1e-10, (one, tp)


@pytest.mark.parametrize("job, argv, rows", [
    ("mlp", ["--strategy", "pipeline", "--batch-size", "5", "--microbatches", "6", "--epochs", "1"], 5),
    ("gpt", ["--batch-size", "5", "--microbatches", "6", "--steps", "1"], 5)], ids=["mlp pipeline", "gpt"])
def test_micro_batches_a_full_batch_would_leave_empty_are_refused(job, argv, rows):
    """Micro-batches beyond a full batch's rows are work for nothing: refused in one line; as many as the rows are
    not (nor a batch that dp or m does not divide: tests/test_partial_batches.py)."""
    status, err = _run(f"minitrain.examples.{job}", argv)
    assert status == 2 and "Traceback" not in err, err
    assert f"error: --microbatches 6 exceeds the {rows} rows of the largest replica's batch" in err, err
    status, err = _run(f"minitrain.examples.{job}", [a if a != "6" else "5" for a in argv] + ["--no-progress"])
    assert status == 0, err


def test_no_command_line_reads_an_abbreviation_as_an_option():
    """Megatron's allow_abbrev=False: `gpt --offload` (the mlp job's optimizer offload) was read as the GPT job's
    --offload-activations, and `mlp --epoch 1` as --epochs 1; every parser now refuses a prefix."""
    assert [(module, prefix) for module, prefix, parser in PARSERS if parser.allow_abbrev] == []
    for module, argv in (("minitrain.examples.gpt", ["--offload"]), ("minitrain.examples.mlp", ["--epoch", "1"]),
                         ("minitrain.plan.__main__", ["gpt", "--world", "2", "--offload"])):
        status, err = _run(module, argv)
        assert status == 2 and "unrecognized arguments: " in err and "Traceback" not in err, (module, err)


@pytest.mark.parametrize("module, job", [("gpt_moe", "minitrain.examples.gpt --moe-experts"),
                                         ("gpt_parallel", "minitrain.examples.gpt"),
                                         ("mlp_pipeline", "minitrain.examples.mlp --strategy pipeline")])
def test_a_job_s_half_run_as_a_program_names_its_job(module, job):
    """python -m minitrain.examples.gpt_moe exited 0 having trained nothing (the module has no main of its own)."""
    import runpy
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        runpy.run_module(f"minitrain.examples.{module}", run_name="__main__")
    assert stop.value.code == 2 and len(err.getvalue().splitlines()) == 1 and job in err.getvalue()

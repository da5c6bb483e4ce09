"""The exercises: every grader rejects its stub and accepts the library's own implementation and a
learner's correct hand-in, and rejects every wrong hand-in in tests/exercise_solutions/ with an
explanation and a hint to read; the command line (list, show, hint, stub, check, run) and the
progress file. Graders run in this process (one import of everything), the CLI in a few subprocesses."""
import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from minitrain.exercises import all_exercises, get, harness
from minitrain.exercises.__main__ import main
from minitrain.exercises.grading import (LoadError, StopGrading, call_with_limit, check_limit, explain, run_checks,
                                         untimed)
from minitrain.exercises.isolation import grade_in_child
from minitrain.exercises.loading import load

SOLUTIONS = pathlib.Path(__file__).parent / "exercise_solutions"
NAMES = [e.name for e in all_exercises()]
WRONG = sorted(SOLUTIONS.glob("*/wrong_*.py"))
GOOD = sorted(SOLUTIONS.glob("*/good_*.py"))
HANG_TIMEOUT = 1.0          # wrong hand-ins that deadlock fail within this many seconds per world


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Progress goes to a temporary file; the wait timeout is the default unless a test changes it."""
    monkeypatch.setenv("MINITRAIN_EXERCISES_PROGRESS", str(tmp_path / "progress.json"))
    harness.set_wait_timeout(harness.DEFAULT_WAIT_TIMEOUT)
    yield
    harness.set_wait_timeout(harness.DEFAULT_WAIT_TIMEOUT)


def cli(*args, env=None):
    """The command line, in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def cli_process(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minitrain.exercises", *args], capture_output=True, text=True,
                          timeout=timeout)


def stub_of(e, tmp_path):
    path = tmp_path / f"{e.name}_stub.py"
    path.write_text(e.stub)
    return path


# ---------------------------------------------------------------- the registry
def test_the_learning_path_has_sixteen_exercises_and_four_bugs_to_hunt():
    kinds = [e.kind for e in all_exercises()]
    assert kinds.count("implement") >= 16 and kinds.count("debug") >= 4
    assert len(set(NAMES)) == len(NAMES) and len({e.order for e in all_exercises()}) == len(NAMES)


def test_each_exercise_points_to_the_notebook_its_readme_row_teaches_it_in():
    """`list` and `show` send a learner to the exercise's NOTEBOOK; the README's capability table names, on the
    row that links the exercise, the notebooks that teach it (by number): the two must agree."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    taught = {}
    for row in readme.splitlines():
        cells = row.split(" | ")
        if row.startswith("| ") and len(cells) == 5:
            for name in re.findall(r"\[(\w+)\]\(minitrain/exercises/catalog/", cells[4]):
                taught[name] = set(re.findall(r"\b(\d\d)\b", cells[3]))
    assert len(taught) >= 20, "the README's capability table no longer links the exercises"
    wrong = {e.name: (e.notebook, sorted(taught[e.name])) for e in all_exercises()
             if e.name in taught and (e.notebook or "")[:2] not in taught[e.name]}
    assert not wrong, f"exercise -> (its NOTEBOOK, the README row's notebooks): {wrong}"


def test_the_readme_counts_the_exercises_there_are():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    said = re.search(r"exercises: (\d+) pieces to write, (\d+) broken programs to fix", readme)
    kinds = [e.kind for e in all_exercises()]
    assert said and tuple(map(int, said.groups())) == (kinds.count("implement"), kinds.count("debug")), said


@pytest.mark.parametrize("name", NAMES)
def test_each_exercise_is_complete_and_reads_as_plain_text(name):
    e = get(name)
    tree = ast.parse(e.stub)
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert set([e.defines] if isinstance(e.defines, str) else e.defines) <= defined
    assert len(e.hints) >= 2 and all(len(h) > 40 for h in e.hints)
    assert e.checks() and all(1 <= c.hint <= len(e.hints) for c in e.checks())
    text = e.intro() + "".join(e.hints) + e.title
    assert not re.search(r"``|:(func|class|meth|mod|ref):`|^\.\. \w+::|\*\*[A-Za-z][^*\n]*\*\*", text, re.M), "markup"
    assert f"check {name}" in e.intro()
    if e.kind == "implement":          # a stub gives the contract, never the code: bodies only raise
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                simple = all(isinstance(s, ast.Raise) or (isinstance(s, ast.Return) and node.name == "__call__")
                             for s in body)
                assert simple, f"{name}: the stub's {node.name} has code beyond raise NotImplementedError"


# ---------------------------------------------------------------- graders
@pytest.mark.parametrize("name", NAMES)
def test_the_grader_rejects_the_stub(name, tmp_path):
    e = get(name)
    harness.set_wait_timeout(HANG_TIMEOUT)
    results = e.grade(e.load(stub_of(e, tmp_path)), fail_fast=True)
    failed = [r for r in results if r.status == "fail"]
    assert failed and failed[0].explanation and failed[0].hint
    if e.kind == "implement":
        assert failed[0].explanation.startswith("not written yet")


@pytest.mark.parametrize("name", NAMES)
def test_the_grader_accepts_the_library_s_own_implementation(name):
    results = get(name).grade(get(name).reference())
    assert all(r.status != "fail" for r in results), "\n".join(f"{r.label}: {r.explanation}" for r in results)


@pytest.mark.parametrize("path", GOOD, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_learner_s_correct_hand_in_passes(path):
    e = get(path.parent.name)
    results = e.grade(e.load(path))
    assert all(r.status != "fail" for r in results), "\n".join(f"{r.label}: {r.explanation}" for r in results)


@pytest.mark.parametrize("path", WRONG, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_wrong_hand_in_fails_with_an_explanation_and_a_hint(path):
    e = get(path.parent.name)
    expected = ast.literal_eval(re.search(r"^EXPECT = (.*)$", path.read_text(), re.M).group(1))
    harness.set_wait_timeout(HANG_TIMEOUT)
    results = e.grade(e.load(path), fail_fast=True)
    failed = [r for r in results if r.status == "fail"]
    assert failed, f"{path.name} passed every check"
    explanation = failed[0].explanation
    assert failed[0].hint and all(fragment in explanation for fragment in expected), explanation
    assert "the grader could not use" not in explanation


def test_every_exercise_has_a_correct_hand_in_and_wrong_ones():
    for e in all_exercises():
        folder = SOLUTIONS / e.name
        assert list(folder.glob("good_*.py")), e.name
        assert len(list(folder.glob("wrong_*.py"))) >= (1 if e.kind == "debug" else 3), e.name


def test_a_debugging_exercise_s_fix_is_exactly_what_turns_the_broken_program_into_its_reference():
    for e in all_exercises():
        if e.kind == "debug":
            fixed = e.stub
            for broken, repaired in e.module.FIX:
                assert e.stub.count(broken) == 1
                fixed = fixed.replace(broken, repaired)
            assert fixed != e.stub and (SOLUTIONS / e.name / "good_fix.py").read_text() == fixed


# ---------------------------------------------------------------- a hand-in that hangs, loops or exits
def test_an_endless_loop_is_stopped_and_reported_with_its_line(tmp_path):
    path = tmp_path / "loops.py"
    path.write_text("def ring_all_reduce(comm, x, op='sum'):\n    while True:\n        pass\n")
    harness.set_wait_timeout(0.3)
    results = get("ring_all_reduce").grade(load(path, "ring_all_reduce"))
    assert results[-1].status == "fail" and len(results) == 1          # grading stops there
    assert "never returned" in results[0].explanation and re.search(r"loops.py line [23]", results[0].explanation)
    assert "did not finish within 2.6 s" in results[0].explanation    # 2 wait timeouts + 2 s, not 10 of them
    harness.set_wait_timeout(harness.DEFAULT_WAIT_TIMEOUT)
    assert check_limit() > harness.world_limit() == 12.0   # a stuck world is reported by the world, rank by rank


def test_on_the_gpu_a_world_has_time_for_cupy_to_compile_its_kernels(standin_gpu):
    """A correct hand-in's first run on a GPU compiles each new kernel (NVRTC: seconds on a cold cache): the
    limits grow by GPU_EXTRA_S there, and only there."""
    assert harness.rank_wait(5.0) == 5.0 + harness.GPU_EXTRA_S
    assert harness.world_limit(5.0) == 2 * (5.0 + harness.GPU_EXTRA_S) + 2
    assert check_limit() > harness.world_limit()


def test_on_the_gpu_a_rank_compiling_longer_than_the_wait_timeout_is_not_a_hang(standin_gpu, tmp_path):
    """Seen on an H200: a rank's first CuPy compile outlasted the 5 s wait and the reference's grade read
    "a deadlock". Each wait there gets GPU_EXTRA_S more: a rank busy 1 s at its first call, with a
    0.3 s wait timeout, passes on the GPU."""
    path = tmp_path / "slow_first_call.py"
    path.write_text("import time\nfrom minitrain.comm import ring_all_reduce as library\nfirst = set()\n"
                    "def ring_all_reduce(comm, x, op='sum'):\n"
                    "    if comm.rank == 1 and comm.size not in first:\n"
                    "        first.add(comm.size)\n        time.sleep(1.0)          # a compile\n"
                    "    return library(comm, x, op=op)\n")
    harness.set_wait_timeout(0.3)
    try:
        results = get("ring_all_reduce").grade(load(path, "ring_all_reduce"))
    finally:
        harness.set_wait_timeout(harness.DEFAULT_WAIT_TIMEOUT)
    assert all(r.status == "pass" for r in results), [r.explanation for r in results if r.status != "pass"]


def test_a_rank_that_loops_while_the_others_end_is_reported_when_they_end(tmp_path):
    """ThreadWorld gives up one wait timeout after the first rank ends; the rank still looping is named
    there, with its line, and stopped (not left spinning through the checks after it)."""
    path = tmp_path / "one_loops.py"
    path.write_text("def ring_all_reduce(comm, x, op='sum'):\n    while comm.rank == 1:\n        pass\n"
                    "    return x.copy()\n")
    harness.set_wait_timeout(0.3)
    results = get("ring_all_reduce").grade(load(path, "ring_all_reduce"))
    assert [r.status for r in results] == ["pass", "fail"], [r.explanation for r in results]   # p=1, then p=2
    assert "ThreadWorld(2) ended 0.3 s after its first rank, but not every rank did: rank(s) [1] never returned" \
        in results[1].explanation and "rank 1: still running at one_loops.py line 2" in results[1].explanation


def test_an_endless_loop_outside_ranks_is_stopped_too(tmp_path):
    path = tmp_path / "spins.py"
    path.write_text("def softmax_backward(out, grad, axis=-1):\n    x = 0\n    while True:\n        x += 1\n")
    results = run_checks(get("softmax_backward").checks(), load(path, "softmax_backward"), limit=1.0)
    assert len(results) == 1 and "did not finish within 1 s" in results[0].explanation
    assert re.search(r"spins.py line [34]", results[0].explanation)


def test_a_check_s_limit_does_not_count_an_oracle_s_import_of_pytorch():
    def check(impl):
        with untimed():              # as need_torch() imports torch: seconds, once, from a cold disk longer
            time.sleep(0.6)
    call_with_limit(check, None, limit=0.3)
    with pytest.raises(StopGrading, match="did not finish within 0.3 s"):
        call_with_limit(lambda impl: time.sleep(0.6), None, limit=0.3)


def test_a_file_whose_top_level_code_never_ends_is_stopped_at_import(tmp_path):
    path = tmp_path / "tests_at_top.py"
    path.write_text("def ring_all_reduce(comm, x, op='sum'):\n    return x\n\nwhile True:\n    pass\n")
    with pytest.raises(LoadError, match=r"importing .*tests_at_top.py did not finish within 0.5 s") as err:
        load(path, "ring_all_reduce", limit=0.5)
    assert re.search(r"tests_at_top.py line [45]", str(err.value)) and 'if __name__ == "__main__"' in str(err.value)


def test_a_hand_in_that_calls_sys_exit_or_raises_is_reported_not_fatal(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\n\ndef softmax_backward(out, grad, axis=-1):\n    sys.exit(3)\n")
    results = get("softmax_backward").grade(load(path, "softmax_backward"))
    assert results[0].status == "fail" and "SystemExit" in results[0].explanation and "exits.py line 4" in results[0].explanation
    path.write_text("def gpipe(p, m):\n    return 42\n")
    results = get("gpipe_schedule").grade(load(path, "gpipe"))
    assert "expected a list of p = 1 stages" in results[0].explanation


@pytest.mark.parametrize("call, said", [
    ("os._exit(0)", "your softmax_backward ended the grader's process (os._exit(0) at ends.py line 5"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "(os.kill(os.getpid(), SIGKILL) at ends.py line 5"),
    ("threading.Thread(target=lambda: os._exit(0)).start(); time.sleep(9)", "(os._exit(0) at ends.py line 5")])
def test_check_of_a_hand_in_that_ends_its_process_fails_naming_how(tmp_path, call, said):
    """check grades in a child process: one that ends before its verdict is a failed check (the checks before
    it keep their results), never silence, never exit status 0, never a pass in the progress file. In a
    subprocess: were the grading in this process, the hand-in would end pytest itself."""
    path = tmp_path / "ends.py"
    path.write_text("import os, signal, threading, time\n\ndef softmax_backward(out, grad, axis=-1):\n"
                    f"    if out.shape == (4, 3):\n        {call}\n"
                    "    return out * (grad - (grad * out).sum(axis, keepdims=True))\n")
    env = dict(os.environ, MINITRAIN_EXERCISES_PROGRESS=str(tmp_path / "p.json"))
    result = subprocess.run([sys.executable, "-m", "minitrain.exercises", "check", "softmax_backward", str(path)],
                            capture_output=True, text=True, timeout=120, env=env)
    said_here = " ".join(result.stdout.split())
    assert result.returncode == 1 and said in said_here, result.stdout + result.stderr
    assert "PASS rows of a (3, 5) input" in said_here and "FAIL columns of a (4, 3) input" in said_here
    assert "1 passed, 1 failed" in said_here
    assert not json.loads((tmp_path / "p.json").read_text())["exercises"]["softmax_backward"]["passed"]


def test_check_of_a_file_that_exits_while_imported_is_a_load_error(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import os\n\ndef ring_all_reduce(comm, x, op='sum'):\n    return x.copy()\n\nos._exit(0)\n")
    env = dict(os.environ, MINITRAIN_EXERCISES_PROGRESS=str(tmp_path / "p.json"))
    result = subprocess.run([sys.executable, "-m", "minitrain.exercises", "check", "ring_all_reduce", str(path)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "importing the file ended the grader's process (os._exit(0) at exits.py line 6" \
        in result.stderr, result.stdout + result.stderr


def test_a_bug_in_the_grader_itself_is_not_blamed_on_the_hand_in():
    class Broken:
        defines = "ring_all_reduce"

        def grade(self, impl, **kwargs):
            raise ValueError("a grader's own bug")
    with pytest.raises(RuntimeError, match="(?s)the grader itself failed .*ValueError: a grader.s own bug"):
        grade_in_child(Broken(), lambda: None)


def test_a_keyboard_interrupt_raised_by_the_hand_in_is_its_failure_not_the_user_s_ctrl_c(tmp_path):
    path = tmp_path / "interrupts.py"
    path.write_text("def softmax_backward(out, grad, axis=-1):\n    raise KeyboardInterrupt\n")
    try:
        results = run_checks(get("softmax_backward").checks(), load(path, "softmax_backward"), fail_fast=True)
        assert "your code raised KeyboardInterrupt" in results[0].explanation and "interrupts.py line 2" in results[0].explanation
        path.write_text("raise KeyboardInterrupt\n")
        with pytest.raises(LoadError, match="raised KeyboardInterrupt while being imported"):
            load(path, "softmax_backward")
    except KeyboardInterrupt:
        pytest.fail("the hand-in's KeyboardInterrupt escaped the grader, as if the user had typed Ctrl-C")


@pytest.mark.parametrize("content, message", [
    (None, "no such file"), ("dir", "is a directory"), (b"\xff\xfe\x00", "not UTF-8"),
    ("def ring_all_reduce(comm, x, op='sum')\n    pass\n", "mine.py line 1: expected ':'"),
    ("import no_such_module_here\n", "ModuleNotFoundError"),
    ("def something_else():\n    pass\n", "defines no ring_all_reduce"),
    ("ring_all_reduce = 3\n", "expected a function or a class")])
def test_a_file_that_cannot_be_graded_is_a_clear_message(tmp_path, content, message):
    path = tmp_path / "mine.py"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(LoadError, match=message):
        load(path, "ring_all_reduce")


def test_explanations_name_the_element_the_ratio_and_the_hint(tmp_path):
    path = SOLUTIONS / "ring_all_reduce" / "wrong_no_mean.py"
    harness.set_wait_timeout(HANG_TIMEOUT)
    failed = [r for r in get("ring_all_reduce").grade(load(path, "ring_all_reduce")) if r.status == "fail"]
    assert re.search(r"rank \d of \d, ring_all_reduce\(n=\d+, float64, op='mean'\): element 0 is", failed[0].explanation)
    assert "= p (2)" in failed[0].explanation and failed[0].hint == 2
    assert explain(NotImplementedError("write it")) == "not written yet: write it"


# ---------------------------------------------------------------- the command line
def test_check_records_progress_and_list_shows_it(tmp_path):
    env = {"MINITRAIN_EXERCISES_PROGRESS": str(tmp_path / "p.json")}
    result = cli("check", "gpipe_schedule", str(SOLUTIONS / "gpipe_schedule" / "good_learner.py"), env=env)
    assert result.returncode == 0 and "12 passed, 0 failed" in result.stdout, result.stdout + result.stderr
    failing = cli("check", "one_f_one_b", str(SOLUTIONS / "one_f_one_b" / "wrong_gpipe.py"), env=env)
    assert failing.returncode == 1 and "Read hint 2: python -m minitrain.exercises hint one_f_one_b --level 2" in failing.stdout
    state = json.loads((tmp_path / "p.json").read_text())["exercises"]
    assert state["gpipe_schedule"]["passed"] and state["gpipe_schedule"]["attempts"] == 1
    assert not state["one_f_one_b"]["passed"] and state["one_f_one_b"]["last_path"].endswith("wrong_gpipe.py")
    listing = cli("list", env=env).stdout
    assert re.search(r"gpipe_schedule\s+implement\s+passed", listing) and re.search(r"one_f_one_b\s+implement\s+tried", listing)
    assert all(name in listing for name in NAMES) and f"1 of {len(NAMES)} passed" in listing


def test_hints_come_one_level_at_a_time(tmp_path):
    env = {"MINITRAIN_EXERCISES_PROGRESS": str(tmp_path / "p.json")}
    hints = get("ring_all_reduce").hints
    first, second = cli("hint", "ring_all_reduce", env=env).stdout, cli("hint", "ring_all_reduce", env=env).stdout
    assert "Hint 1 of 3" in first and hints[0][:40] in " ".join(first.split()) and "Hint 2" not in first
    assert "Hint 2 of 3" in second and "Next: python -m minitrain.exercises hint ring_all_reduce" in second
    assert "Hint 3 of 3" in cli("hint", "ring_all_reduce", "--level", "3", env=env).stdout
    everything = cli("hint", "ring_all_reduce", "--all", env=env).stdout
    assert all(f"Hint {k} of 3" in everything for k in (1, 2, 3))
    assert json.loads((tmp_path / "p.json").read_text())["exercises"]["ring_all_reduce"]["hints_read"] == 3
    assert cli("hint", "ring_all_reduce", "--level", "9", env=env).returncode == 2


def test_a_progress_file_it_cannot_read_is_kept_and_never_stops_the_command(tmp_path, monkeypatch):
    """Not JSON, another layout, an entry of the wrong type: a note, the command goes on afresh, and the file is moved
    to NAME.unreadable (never written over) at the first save; a folder: read as nothing and never written; a save
    that fails leaves no temporary file."""
    for name, text in {"corrupt.json": "{bad", "list.json": "[]", "entry.json": '{"exercises": {"ring_all_reduce": 5}}',
                       "types.json": '{"exercises": {"ring_all_reduce": {"hints_read": "2"}}}',
                       "passed.json": '{"exercises": {"ring_all_reduce": {"passed": "no"}}}'}.items():
        path = tmp_path / name
        path.write_text(text)
        for command in (("list",), ("show", "ring_all_reduce"), ("hint", "ring_all_reduce")):
            result = cli("--progress", str(path), *command)
            assert result.returncode == 0 and f"note: the progress file {path} " in result.stderr, (name, result)
        assert f"starting afresh (the file is kept as {path}.unreadable when progress is saved)" in result.stderr
        assert (tmp_path / f"{name}.unreadable").read_text() == text
        assert json.loads(path.read_text())["exercises"]["ring_all_reduce"]["hints_read"] == 1
    folder = tmp_path / "folder"
    folder.mkdir()
    result = cli("--progress", str(folder), "hint", "ring_all_reduce")
    assert result.returncode == 0 and result.stderr == f"note: the progress file {folder} is not a file; progress " \
                                                       f"is not saved\n", result.stderr
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    result = cli("--progress", str(tmp_path / "p.json"), "hint", "ring_all_reduce")
    assert result.returncode == 0 and "could not save progress to" in result.stderr
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    for argv in (["--progress", "", "list"], ["check", "ring_all_reduce", "mine.py", "--reference"]):
        with pytest.raises(SystemExit) as exit_:      # an empty path is not the default; PATH is not graded
            cli(*argv)
        assert exit_.value.code == 2


def test_show_stub_and_a_missing_file_on_the_command_line(tmp_path):
    shown = cli("show", "ddp_buckets")
    assert shown.returncode == 0 and "class BucketedDDP" in shown.stdout and "register_post_accumulate_grad_hook" in shown.stdout
    assert "- p=4: one all-reduce per bucket, launched during backward" in shown.stdout and "``" not in shown.stdout
    dest = tmp_path / "mine.py"
    assert cli("stub", "ddp_buckets", str(dest)).returncode == 0 and dest.read_text() == get("ddp_buckets").stub
    refused = cli("stub", "ddp_buckets", str(dest))
    assert refused.returncode == 2 and "--force" in refused.stderr
    into = cli("stub", "ddp_buckets", str(tmp_path))                  # a folder: the file goes in it, as cp puts it
    assert into.returncode == 0 and (tmp_path / "ddp_buckets.py").read_text() == get("ddp_buckets").stub
    missing = cli_process("check", "ddp_buckets", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    unknown = cli("show", "ring_allreduce")
    assert unknown.returncode == 2 and "did you mean ring_all_reduce" in unknown.stderr


def test_run_shows_what_minitrain_reports_for_a_broken_program(tmp_path):
    result = cli("run", "debug_pipeline_hang", "--timeout", "1")
    assert result.returncode == 1 and "minitrain reports" in result.stdout
    assert "hung" in result.stdout and "debug_pipeline_hang_broken.py line" in result.stdout
    mine = tmp_path / "mine.py"
    mine.write_text((SOLUTIONS / "debug_pipeline_hang" / "good_fix.py").read_text())
    fixed = subprocess.run([sys.executable, str(mine)], capture_output=True, text=True, timeout=120)
    assert fixed.returncode == 0 and "equals one process at p = 2" in fixed.stdout, fixed.stdout + fixed.stderr
    assert cli("run", "ring_all_reduce").returncode == 2


def test_run_names_the_ranks_whose_split_sizes_disagree():
    """The expert-parallel program's report: the sizes disagree (not a hang), each pair of ranks with
    both counts, and the line of the exchange; the fixed program equals one process."""
    result = cli("run", "debug_expert_split_sizes", "--timeout", "1")
    out = result.stdout
    assert result.returncode == 1 and "split sizes disagree" in out and "would have hung" not in out, out
    assert "rank 0 sends 3 rows to rank 1, which expects 4 from rank 0" in out, out
    assert "debug_expert_split_sizes_broken.py line" in out
    fixed = cli("run", "debug_expert_split_sizes", str(SOLUTIONS / "debug_expert_split_sizes" / "good_fix.py"))
    assert fixed.returncode == 0 and "equals one process at p = 2" in fixed.stdout, fixed.stdout


# ---------------------------------------------------------------- on the GPU (the strict CuPy stand-in)
def test_on_the_gpu_the_grader_hands_device_arrays_and_explains_numpy_code(tmp_path):
    """MINITRAIN_DEVICE=cuda under the stand-in: a device-agnostic hand-in passes; one written with
    np.zeros fails with the explanation that NumPy and CuPy do not mix; one that copies its result
    to the host is told to stay on the GPU (the device suite grades every reference there)."""
    standin = pathlib.Path(__file__).parent / "standin"
    env = dict(os.environ, MINITRAIN_DEVICE="cuda", CUPY_STANDIN_IMPLICIT="error",
               PYTHONPATH=os.pathsep.join([str(standin), os.environ.get("PYTHONPATH", "")]),
               MINITRAIN_EXERCISES_PROGRESS=str(tmp_path / "p.json"))
    on_host = tmp_path / "on_host.py"
    on_host.write_text("def matmul_backward(a, b, grad):\n    a, b, grad = a.get(), b.get(), grad.get()\n"
                       "    return grad @ b.T, a.reshape(-1, a.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])\n")
    runs = {}
    for label, name, path in (("agnostic", "matmul_backward", SOLUTIONS / "matmul_backward" / "good_learner.py"),
                              ("numpy", "zero1_step", SOLUTIONS / "zero1_step" / "good_learner.py"),
                              ("host", "matmul_backward", on_host)):
        runs[label] = subprocess.run([sys.executable, "-m", "minitrain.exercises", "check", name, str(path), "--fail-fast"],
                                     capture_output=True, text=True, timeout=120, env=env)
    assert runs["agnostic"].returncode == 0, runs["agnostic"].stdout + runs["agnostic"].stderr
    numpy_only = " ".join(runs["numpy"].stdout.split())
    assert runs["numpy"].returncode == 1 and "NumPy and CuPy arrays do not mix" in numpy_only, numpy_only
    assert "good_learner.py line" in numpy_only             # the learner's line, not the stand-in's
    host_copy = " ".join(runs["host"].stdout.split())
    assert runs["host"].returncode == 1 and "returned a NumPy array (host memory)" in host_copy, host_copy


def test_the_zigzag_grader_counts_the_work_the_issue_states():
    """The oracles behind zigzag_split: in blocks of T/P the contiguous split's last rank computes
    2P/(P+1) times the mean; the zig-zag split computes 2P+1 blocks of T/(2P) on every rank and the
    same number of (query, key) pairs; the contiguous split's explanation gives that ratio."""
    from minitrain.exercises.oracles import causal_blocks, causal_pairs, zigzag_indices
    for P in range(1, 9):
        T = 4 * P
        contiguous = [causal_blocks(range(r * T // P, (r + 1) * T // P), T, P) for r in range(P)]
        assert max(contiguous) / (sum(contiguous) / P) == pytest.approx(2 * P / (P + 1), rel=1e-12)
        assert [causal_blocks(zigzag_indices(T, P, r), T, 2 * P) for r in range(P)] == [2 * P + 1] * P
        assert len({causal_pairs(zigzag_indices(T, P, r)) for r in range(P)}) == 1
    with pytest.raises(ValueError, match="does not split into 2\\*cp = 4"):
        zigzag_indices(10, 2, 0)

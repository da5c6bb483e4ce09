"""The jobs show training (nanoGPT's train.py: a flat loop), and their numbers add up.

Structure, read with ast: examples/mlp.py fits on a few screens, its training loop holds no timer, trace
or memory-ledger line (examples/report.py's StepWatch attaches them around each step), and no module of
examples/ imports another that imports it back. Numbers, read from the JSON of small runs: per rank,
compute + exposed communication is the step and no column is larger than the step it is part of; the
figures are steady state (the first steps and the step timer's own anchor work left out)."""
import ast
import json
import pathlib
import sys

import pytest

from minitrain.examples import mlp, report
from minitrain.testing import run_mpi

EXAMPLES = pathlib.Path(mlp.__file__).parent
# names that would put timing, tracing or the memory ledger back into the loop
MACHINERY = {"trace", "span", "tracer", "timer", "StepTimer", "perf_counter", "thread_time", "time", "memory",
             "persistent_memory", "host_snapshot", "snapshot", "peak", "reset_peak"}


def test_the_mlp_job_fits_in_200_lines():
    assert len((EXAMPLES / "mlp.py").read_text().splitlines()) <= 200


def test_the_mlp_training_loop_holds_no_timer_trace_or_ledger_line():
    tree = ast.parse((EXAMPLES / "mlp.py").read_text())
    loop = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "train")
    names = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(loop) if isinstance(n, ast.Attribute)}
    assert not names & MACHINERY, sorted(names & MACHINERY)
    assert any(isinstance(n, ast.For) for n in ast.walk(loop))            # it is the loop


def _imports(path):
    """The examples/ modules that ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:                               # from .report import ...; from . import checkpointing
                found |= {module} if module else {a.name for a in node.names}
            elif module == "minitrain.examples":
                found |= {a.name for a in node.names}
            elif module.startswith("minitrain.examples."):
                found.add(module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("minitrain.examples.")}
    return found


def test_no_import_circle_in_examples():
    graph = {p.stem: _imports(p) & {q.stem for q in EXAMPLES.glob("*.py")} for p in EXAMPLES.glob("*.py")}
    assert graph["mlp"] >= {"mlp_pipeline", "report"}          # the reader sees the edges it should
    circles = []

    def visit(module, path):
        for nxt in sorted(graph[module]):
            if nxt in path:
                circles.append(path[path.index(nxt):] + [nxt])
            else:
                visit(nxt, path + [nxt])
    for start in graph:
        visit(start, [start])
    assert not circles, circles


def _span(name, start, end, thread="main", kind="comm"):
    return {"name": name, "kind": kind, "start": start, "end": end, "thread": thread, "rank": 0, "args": {}}


def test_a_step_s_communication_is_clipped_to_the_step_and_overlaps_once():
    events = [_span("ring_all_reduce", 0.5, 1.5, thread="progress"),      # begun before the step: clipped
              _span("ring_all_reduce", 1.2, 1.8, thread="progress"),      # overlaps the first: counted once
              _span("wait for buckets", 1.6, 2.5),
              _span("wait for buckets", 2.4, 2.6, thread="progress"),     # not the loop's thread: not exposed
              _span("ring_all_reduce", 2.9, 4.0, thread="progress"),      # runs past the step's end: clipped
              _span("step", 1.0, 3.0, kind="step")]
    exposed, total = report.step_communication(events)
    assert exposed == pytest.approx(0.9)                   # 1.6..2.5
    assert total == pytest.approx(1.5 + 0.1)               # 1.0..2.5 and 2.9..3.0
    assert exposed <= total <= 2.0


def test_the_step_timer_s_anchor_is_left_out_of_every_step(monkeypatch):
    """The timer's reference work (plan.anchor.anchor, after each of the first 20 steps) is the timer's cost,
    not the job's: on a clock the test moves, a step of 1 unit reads 1 with an anchor of 100 beside it."""
    from types import SimpleNamespace

    from minitrain.examples import step_timer
    from minitrain.plan import anchor as planner_anchor
    clock = [0.0]
    monkeypatch.setattr(step_timer, "time", SimpleNamespace(perf_counter=lambda: clock[0], thread_time=lambda: clock[0]))
    monkeypatch.setattr(planner_anchor, "anchor", lambda: clock.__setitem__(0, clock[0] + 100.0))
    watch = report.StepWatch()
    watch.timer.anchoring = True
    for _ in range(6):
        with watch.step():
            clock[0] += 1.0
    assert [wall for wall, *_ in watch.timer.steps] == [1.0] * 6
    assert [t for _, t in watch.timer.anchors] == [100.0] * 6
    figures, summary = watch.figures(), watch.timer.summary()
    assert figures["step_s"] == summary["step_time_s"] == 1.0
    assert watch.steady_state()["steps_measured"] == 6 - step_timer.WARMUP_STEPS
    assert figures["compute_s"] + figures["comm_exposed_s"] == figures["step_s"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "mlp.json"
    result = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--epochs", "1",
                      "--json", out], n=2, timeout=120)
    return json.loads(out.read_text()), result.stdout


def test_per_rank_compute_and_exposed_communication_make_the_step(ddp_run):
    report_, _ = ddp_run
    for r in report_["ranks"]:
        step = r["step_seconds"]
        assert r["compute_seconds_per_step"] + r["comm_exposed_seconds_per_step"] == pytest.approx(step, abs=1e-12)
        assert 0 <= r["comm_exposed_seconds_per_step"] <= r["comm_total_seconds_per_step"] <= step
        assert 0 <= r["compute_seconds_per_step"] <= step


def test_the_figures_are_steady_state_and_say_so(ddp_run):
    """The step in the table is the timer's steady-state median (the first steps and its anchor left out), and
    samples/s follow from it: no figure divides by a wall clock that holds the timer's own work."""
    report_, _ = ddp_run
    steady = report_["steady_state"]
    counted = report_["steps"] - 1                           # 1437 digits: the short last batch is not timed
    assert steady["statistic"] == "median" and steady["steps_measured"] == counted - steady["skipped_first_steps"] > 0
    slowest = max(r["step_seconds"] for r in report_["ranks"])
    for r in report_["ranks"]:
        assert r["step_seconds"] == r["step"]["step_time_s"]
        assert r["samples_per_second"] == pytest.approx(64 / 2 / r["step_seconds"])
    assert report_["samples_per_second"] == pytest.approx(64 / slowest)
    assert report_["step_time_s"] == slowest


def test_the_default_output_leaves_the_planner_to_an_option_and_the_json(ddp_run, tmp_path, capsys):
    report_, printed = ddp_run
    assert "planner (" not in printed and "rank  device" in printed and "test accuracy" in printed
    assert report_["planner"]["predicted"]["step_time_s"] > 0 and report_["planner"]["measured"]["memory_bytes"] > 0
    assert mlp.main(["--no-progress", "--epochs", "1", "--show-plan"]) == 0
    assert "planner (python -m minitrain.plan mlp <these options> --world 1)" in capsys.readouterr().out

"""Strategies read as their papers: DDP and FSDP fit on a screen or two, carry no memory-ledger,
trace or byte-counting line (that accounting attaches from outside, parallel/accounting.py), and
the pipeline runtime's dispatch of F/B/W actions takes no timing stamp (pipeline/stamps.py does).
Read from the code (ast), then checked to still attach where the jobs read it."""
import ast
from pathlib import Path

import numpy as np

import minitrain as mt
from minitrain import memory, nn, trace
from minitrain.nn import functional as F
from minitrain.parallel import DistributedDataParallel, FullyShardedDataParallel
from minitrain.comm import ThreadWorld

PARALLEL = Path(mt.__file__).parent / "parallel"
MAX_OWN_LINES = 150
# what the strategies used to interleave with their algorithm: the memory ledger (memory.tracker()
# .add/.remove, weakref.finalize of its entries), trace spans, the bytes a step sent (comm.stats)
ACCOUNTING = {"tracker", "finalize", "span", "tracer", "stats", "bytes_sent", "step_bytes_sent", "_bytes_before"}
# the pipeline's timing: the host clock, CUDA events, the step's stamp rows
TIMING = {"time", "perf_counter", "clock", "record_event", "event", "stamps", "times", "device_times"}
STRATEGIES = {"data_parallel.py": ["_Bucket", "DistributedDataParallel"],
              "fsdp.py": ["_UnitRef", "_Unit", "FullyShardedDataParallel"]}
DISPATCH = ["_run_actions", "_message", "_post", "_receive", "_compute", "_send_result", "_forward", "_backward",
            "_weight"]
MESSAGES = ["send", "progress", "post", "recv", "wait", "wait_for_sends"]     # pipeline/messages.py's StageMessages


def _tree(path):
    return ast.parse(path.read_text())


def _definition(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)


def own_lines(node):
    """The lines of a class, its decorators and docstring included."""
    return node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1


def identifiers(node):
    """Every name and attribute a definition's body uses (its decorators left out: they are the seam)."""
    body = node.body
    found = set()
    for part in body:
        for n in ast.walk(part):
            if isinstance(n, ast.Name):
                found.add(n.id)
            elif isinstance(n, ast.Attribute):
                found.add(n.attr)
    return found


def imported_modules(tree):
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[-1] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            names |= {a.name for a in n.names} | {(n.module or "").split(".")[-1]}
    return names


def test_ddp_and_fsdp_each_fit_in_150_lines_of_their_own():
    for file, (*_, strategy) in STRATEGIES.items():
        tree = _tree(PARALLEL / file)
        lines = own_lines(_definition(tree, strategy))
        assert lines <= MAX_OWN_LINES, f"{strategy} ({file}) has {lines} lines, more than {MAX_OWN_LINES}"
        assert len((PARALLEL / file).read_text().splitlines()) <= 300, f"{file} is over 300 lines"


def test_ddp_and_fsdp_hold_no_memory_ledger_trace_or_byte_counting_line():
    for file, classes in STRATEGIES.items():
        tree = _tree(PARALLEL / file)
        found = {name: sorted(identifiers(_definition(tree, name)) & ACCOUNTING) for name in classes}
        assert not any(found.values()), f"{file}: accounting inside the strategy: {found}"
        imported = imported_modules(tree) & {"trace", "weakref", "stats", "time"}
        assert not imported, f"{file} imports {sorted(imported)}: accounting belongs in accounting.py"


def test_the_pipeline_dispatch_takes_no_timing_stamp():
    tree = _tree(PARALLEL / "pipeline" / "runtime.py")
    found = {name: sorted(identifiers(_definition(tree, name)) & TIMING) for name in DISPATCH}
    assert not any(found.values()), f"runtime.py: timing inside the dispatch of actions: {found}"
    assert "time" not in imported_modules(tree), "runtime.py imports time: its stamps belong in stamps.py"
    messages = _definition(_tree(PARALLEL / "pipeline" / "messages.py"), "StageMessages")
    found = {f.name: sorted(identifiers(f) & TIMING) for f in messages.body
             if isinstance(f, ast.FunctionDef) and f.name in MESSAGES}
    assert set(found) == set(MESSAGES) and not any(found.values()), f"messages.py: timing in its messages: {found}"


def _ddp_ledger_and_spans(comm):
    mt.manual_seed(0)
    tracker = memory.tracker()
    before = tracker.live["comm_buffers"]
    ddp = DistributedDataParallel(nn.MLP([6, 8, 3]), comm, bucket_cap_mb=0.0005)
    buckets = sum(b.flat.nbytes + b.reduced.nbytes for b in ddp.buckets)
    counted = tracker.live["comm_buffers"] - before
    trace.enable(rank=comm.rank)
    F.cross_entropy(ddp(mt.Tensor(np.ones((4, 6)))), np.zeros(4, np.int64)).backward()
    names = {e["name"] for e in trace.events()}
    trace.disable()
    return buckets, counted, names, ddp.step_bytes_sent


def test_the_accounting_still_attaches_to_ddp():
    for buckets, counted, names, sent in ThreadWorld(2).run(_ddp_ledger_and_spans):
        assert counted == buckets > 0                       # the buckets are comm_buffers while DDP lives
        assert {"wait for buckets"} <= names and sent > 0


def _fsdp_ledger_and_spans(comm):
    mt.manual_seed(0)
    tracker = memory.tracker()
    fsdp = FullyShardedDataParallel(nn.MLP([6, 8, 3]), comm)
    tracker.reset()
    trace.enable(rank=comm.rank)
    F.cross_entropy(fsdp(mt.Tensor(np.ones((4, 6)))), np.zeros(4, np.int64)).backward()
    names = {e["name"] for e in trace.events()}
    trace.disable()
    staging = max(u.flat.padded for u in fsdp.units) * 8
    return tracker.peak_by_category["comm_buffers"], staging, tracker.live["comm_buffers"], names


def test_the_accounting_still_attaches_to_fsdp(float64):
    for peak, staging, live, names in ThreadWorld(2).run(_fsdp_ledger_and_spans):
        assert peak >= staging and live == 0                # staging counted in backward, released after
        assert {"all-gather 0", "wait for reduce-scatter"} <= names, names

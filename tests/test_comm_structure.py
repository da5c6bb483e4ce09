"""comm/ in two layers, read from the code: the core Communicator (communicator.py) fits in 200
lines and imports none of the guard's modules, even through the files it imports; the ring
collectives (rings.py) each read as one function of at most 40 lines; the collectives' files name
no transport; no two files of comm/ import each other, directly or around a circle (imports inside functions included).
And the seam works both ways: the guard is on by default, and the core alone still computes."""
import ast
import pathlib

import numpy as np
import pytest

from minitrain.comm import ThreadWorld, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from minitrain.comm.guard import Guard
from minitrain.comm.seam import Unguarded

COMM = pathlib.Path(__file__).resolve().parent.parent / "minitrain" / "comm"
GUARD_MODULES = {"guard", "headers", "reports", "flight_recorder", "flight_verdict", "flight_text", "watchdog", "death_watch"}
TRANSPORT_MODULES = {"wire", "host", "staging", "ipc", "nccl", "transport", "mpi", "local"}
CORE_LINES, RING_LINES = 200, 40


def comm_imports(path):
    """The files of comm/ that ``path`` imports (module level or inside a function; relative, or
    absolute through minitrain.comm)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["minitrain", "comm"] and len(parts) > 2:
                    found.add(parts[2])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 or (node.level == 0 and (node.module or "").startswith("minitrain.comm")):
                module = (node.module or "").split(".")
                module = module[2:] if node.level == 0 else module
                if module and module[0]:
                    found.add(module[0])
                else:                        # from . import x: x is a file of comm/ (or a name of __init__)
                    found |= {a.name for a in node.names if (COMM / f"{a.name}.py").exists()} or {"__init__"}
    return found - {path.stem}


def import_graph():
    return {path.stem: comm_imports(path) for path in sorted(COMM.glob("*.py"))}


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def find_cycle(graph):
    """One import circle as a list of files (first == last), or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def function_lines(path, name):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path.name} defines no function {name}")


def test_the_core_communicator_fits_in_200_lines():
    lines = len((COMM / "communicator.py").read_text().splitlines())
    assert lines <= CORE_LINES, f"comm/communicator.py has {lines} lines (at most {CORE_LINES})"


def test_the_core_imports_no_guard_module_even_indirectly():
    graph = import_graph()
    direct = graph["communicator"] & GUARD_MODULES
    assert not direct, f"comm/communicator.py imports the guard's {sorted(direct)}"
    through = reachable(graph, "communicator") & GUARD_MODULES
    assert not through, f"comm/communicator.py reaches the guard's {sorted(through)} through the files it imports"


@pytest.mark.parametrize("name", ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"])
def test_each_ring_collective_reads_as_one_function_of_at_most_40_lines(name):
    lines = function_lines(COMM / "rings.py", name)
    assert lines <= RING_LINES, f"rings.py: {name} has {lines} lines (at most {RING_LINES})"


@pytest.mark.parametrize("name", ["rings.py", "reductions.py", "collectives.py", "alltoallv.py"])
def test_the_collectives_name_no_transport(name):
    path = COMM / name
    imported = comm_imports(path) & TRANSPORT_MODULES
    assert not imported, f"{name} imports the transport modules {sorted(imported)}"
    transports = set()
    for module in TRANSPORT_MODULES:
        tree = ast.parse((COMM / f"{module}.py").read_text())
        transports |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    tree = ast.parse(path.read_text())
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not named & transports, f"{name} names {sorted(named & transports)}"


def test_no_import_circle_among_the_files_of_comm():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle in comm/: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _collectives(comm):
    x = np.arange(11.0) + comm.rank
    return (ring_all_reduce(comm, x), ring_reduce_scatter(comm, x), ring_all_gather(comm, x[:comm.rank + 1]),
            type(comm.guard), type(comm.split(comm.rank % 2).guard))


def test_the_guard_is_on_by_default_and_the_core_alone_computes_the_same():
    guarded = ThreadWorld(3).run(_collectives)
    plain = ThreadWorld(3, guard=False).run(_collectives)
    for (*g, guard, child), (*c, none, none_child) in zip(guarded, plain):
        assert (guard, child) == (Guard, Guard) and (none, none_child) == (Unguarded, Unguarded)
        for a, b in zip(g, c):
            assert np.array_equal(a, b)

"""The import direction docs/architecture.md names, enforced: every import in minitrain/ (module
level or inside a function, absolute or relative) is parsed with ast, resolved to the layer it
reaches (a package or module directly under minitrain/), and checked against the table in the
document, so the map and the code cannot drift apart. The document's known exceptions must still
exist (a fixed one is taken off the list). And every module under minitrain/ has its line in the
document's tables, none of which names a module that is gone."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minitrain"
DOC = ROOT / "docs" / "architecture.md"


def _block_after(heading, index=0):
    """The index-th fenced code block after the line ``heading`` in the architecture document."""
    text = DOC.read_text()
    start = text.index(heading)
    blocks = re.findall(r"```\n(.*?)```", text[start:], re.S)
    return blocks[index]


def rules():
    """layer -> the set of layers it may import (the document's table)."""
    table = {}
    for line in _block_after("## Who may import whom").strip().splitlines():
        layer, allowed = (part.strip() for part in line.split("->"))
        table[layer] = set() if allowed == "-" else {a.strip() for a in allowed.split(",")}
    return table


def known_exceptions():
    """{(file, layer)} the document lists as waiting for a fix: the code block after "Known
    exceptions", if the paragraph has one before the next section (none: no exception)."""
    text = DOC.read_text()
    start = text.index("Known exceptions")
    section = text[start:text.find("\n## ", start)]
    block = re.search(r"```\n(.*?)```", section, re.S)
    found = set()
    for line in (block.group(1) if block else "").strip().splitlines():
        path, rest = (part.strip() for part in line.split("->", 1))
        found.add((path, rest.split()[0]))
    return found


def layer_of(path):
    """The layer a file of minitrain/ belongs to: its first component under minitrain/."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return "minitrain" if parts == ("__init__",) else parts[0]


def _module_of(path):
    parts = ("minitrain",) + path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(dotted):
    target = ROOT.joinpath(*dotted)
    return target.with_suffix(".py").exists() or (target / "__init__.py").exists()


def imported_layers(path, tree=None):
    """Every (line, layer of minitrain) that the file imports, resolved as Python would."""
    tree = tree or ast.parse(path.read_text(), str(path))
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module[:-1]
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [tuple(a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = tuple(package[:len(package) - node.level + 1]) if node.level else ()
            base += tuple(node.module.split(".")) if node.module else ()
            for alias in node.names:       # from X import name: the submodule X.name if it is one, else X
                targets.append(base + (alias.name,) if _is_module(base + (alias.name,)) else base)
        for target in targets:
            if target and target[0] == "minitrain":
                found.append((node.lineno, "minitrain" if len(target) == 1 else target[1]))
    return found


def violations(files=None):
    table = rules()
    out = []
    for path in files or sorted(PACKAGE.rglob("*.py")):
        mine = layer_of(path)
        for line, layer in sorted(set(imported_layers(path))):
            if layer != mine and layer not in table[mine]:
                out.append((str(path.relative_to(ROOT)), line, mine, layer))
    return out


def test_every_layer_of_minitrain_is_in_the_table():
    layers = {layer_of(p) for p in PACKAGE.rglob("*.py")}
    table = rules()
    assert layers == set(table), f"missing from the table: {layers - set(table)}; not in minitrain: {set(table) - layers}"
    for layer, allowed in table.items():
        assert allowed <= set(table), f"{layer} may import unknown layers {allowed - set(table)}"


def test_the_table_keeps_the_design_s_rules():
    """The design's rules (comm below autograd, models unaware of strategies, nothing imports the
    jobs), checked on the table itself, so that a loosened table fails too."""
    table = rules()
    assert not table["comm"] & {"autograd", "nn", "optim", "parallel", "testing", "minitrain"}
    assert not table["nn"] & {"comm", "parallel"} and not table["optim"] & {"comm", "parallel"}
    assert not table["autograd"] & {"nn", "optim", "comm", "parallel"}
    assert not any(layer in table[other] for layer in ("checkpoint", "plan") for other in ("parallel", "nn", "comm"))
    assert not any("examples" in allowed for layer, allowed in table.items() if layer != "examples")
    assert all("minitrain" not in table[low] for low in ("backend", "autograd", "nn", "optim", "comm", "parallel"))


def test_imports_follow_the_layers_of_docs_architecture():
    known = known_exceptions()
    found = [v for v in violations() if (v[0], v[3]) not in known]
    assert not found, "imports against docs/architecture.md's layers:\n" + "\n".join(
        f"  {path} line {line}: {mine} imports {layer}" for path, line, mine, layer in found)


def test_comm_reaches_no_tensor_layer_even_through_another_module():
    """comm moves arrays: no file of comm/ may import, directly or through the layers it imports
    (testing.py reaches autograd, say), autograd, nn, optim or parallel; never an exception."""
    imports = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        imports.setdefault(layer_of(path), set()).update(layer for _, layer in imported_layers(path))
    reached, todo = set(), ["comm"]
    while todo:
        for layer in imports.get(todo.pop(), ()):
            if layer not in reached:
                reached.add(layer)
                todo.append(layer)
    assert not reached & {"autograd", "nn", "optim", "parallel", "testing", "minitrain"}, \
        f"comm reaches {sorted(reached)}; its files: {[v for v in violations() if v[2] == 'comm']}"
    assert not any(path.startswith("minitrain/comm/") for path, _ in known_exceptions())


def test_the_known_exceptions_still_exist():
    """A fixed exception must leave the document's list (the list only shrinks)."""
    present = {(path, layer) for path, _, _, layer in violations()}
    stale = known_exceptions() - present
    assert not stale, f"fixed, so take them off docs/architecture.md's list: {sorted(stale)}"


@pytest.mark.parametrize("source, layer, expected", [
    ("from ..autograd import Tensor\n", "comm", ["autograd"]),              # relative, two levels up
    ("def f():\n    from minitrain.parallel import DistributedDataParallel\n", "nn", ["parallel"]),  # lazy
    ("from .. import backend, Tensor\n", "comm", ["backend", "minitrain"]),  # a module, and a name of the package
    ("import minitrain.comm.collectives\n", "optim", ["comm"]),
])
def test_the_import_parser_resolves_what_python_would(tmp_path, source, layer, expected):
    path = PACKAGE / layer / "_example.py"
    found = [name for _, name in imported_layers(path, ast.parse(source))]
    assert found == expected


# ---- every module has its line in the document
def _named_in(text):
    """{path under minitrain/ (a module, or a folder for its __init__.py)} that the document's tables
    name in their first cell. A bare name is relative to the folder named (`` `comm/` ...``) by the
    last line outside a table since the section began; a name with a slash is relative to minitrain/."""
    named, folder = {}, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            folder = ""
        elif line.startswith("|"):
            first = line.split("|")[1]
            for token in re.findall(r"`([\w./]+)`", first):
                token = token.removeprefix("minitrain/")
                path = token if "/" in token.rstrip("/") else folder + token
                named[path.rstrip("/") if path.endswith("/") else path] = number
        else:
            lead = re.match(r"`([\w/]+/)`", line)
            if lead:
                folder = lead.group(1).removeprefix("minitrain/")
    return named


def unnamed_modules(text, package=PACKAGE):
    """(modules with no line, lines naming a module that does not exist), as paths under minitrain/."""
    named = _named_in(text)
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if path.name == "__init__.py":
            folder = rel.rsplit("/", 1)[0] if "/" in rel else None
            if (folder or rel) not in named:
                missing.append(rel if folder is None else f"{folder}/ (its __init__.py)")
        elif rel not in named:
            missing.append(rel)
    stale = [f"{rel} (line {line})" for rel, line in sorted(named.items())
             if rel.endswith(".py") and not (package / rel).is_file()]
    return missing, stale


def test_the_document_names_every_module():
    missing, stale = unnamed_modules(DOC.read_text())
    assert not missing, ("modules docs/architecture.md does not name: add a row `| `name.py` | one idea |` to the "
                         f"table of their folder (\"Inside the rooms\"): {missing}")
    assert not stale, f"docs/architecture.md names modules that do not exist (moved or removed?): {stale}"


def test_a_new_module_without_its_line_is_found(tmp_path):
    package = tmp_path / "minitrain"
    (package / "comm").mkdir(parents=True)
    for rel in ("__init__.py", "backend.py", "comm/__init__.py", "comm/ring.py", "comm/dummy.py"):
        (package / rel).write_text("")
    doc = ("## The rooms\n\n| room | idea |\n|---|---|\n| `__init__.py` | the package |\n| `comm/` | bytes |\n"
           "| `backend.py` | arrays |\n\n## Inside\n\n`comm/`:\n\n| module | idea |\n|---|---|\n| `ring.py` | the ring |\n"
           "| `gone.py` | moved away |\n")
    missing, stale = unnamed_modules(doc, package)
    assert missing == ["comm/dummy.py"]
    assert stale == ["comm/gone.py (line 16)"]

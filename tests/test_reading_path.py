"""The documents a newcomer reads, held to what they promise: docs/reading.md names definitions that
exist and fit on one screen (at most 80 lines), its glossary defines the words the code and the jobs
use, and the README stays short (at most 350 lines) with no issue numbers in its headings."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
READING = ROOT / "docs" / "reading.md"
README = ROOT / "README.md"
MAX_LINES = 80
README_MAX_LINES = 350
GLOSSARY_TERMS = ["Ψ", "ledger", "teaching device", "flight record", "anchor", "busy CPU",
                  "stall threshold", "bubble"]
ENTRY = re.compile(r"`([\w./-]+\.py):([A-Za-z_][\w.]*)`")


def entries(text):
    """Every ``path.py:Name`` the document names, as (line number, path, dotted name)."""
    return [(number, m.group(1), m.group(2))
            for number, line in enumerate(text.splitlines(), 1) for m in ENTRY.finditer(line)]


def definitions(source, filename="<doc>"):
    """{dotted name: its length in lines, decorators included} for every class and function of a
    module, methods as Class.method (nested functions left out: a reader cannot jump to them)."""
    found = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                found[prefix + node.name] = node.end_lineno - start + 1
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + node.name + ".")
    walk(ast.parse(source, filename).body, "")
    return found


def problems(text, root=ROOT):
    """One line per entry that broke: which line of the document, which entry, and why."""
    out = []
    for number, path, name in entries(text):
        where = f"docs/reading.md line {number}: `{path}:{name}`"
        file = root / path
        if not file.is_file():
            out.append(f"{where}: no file {path}")
            continue
        defs = definitions(file.read_text(), str(file))
        if name not in defs:
            close = sorted(d for d in defs if d.split(".")[-1] == name.split(".")[-1] or d.startswith(name.split(".")[0]))
            out.append(f"{where}: {path} defines no {name}" + (f" (it has {', '.join(close[:6])})" if close else ""))
        elif defs[name] > MAX_LINES:
            out.append(f"{where}: {defs[name]} lines, more than {MAX_LINES}: point at a smaller definition")
    return out


def glossary(text):
    """{term: definition} from the glossary's ``- **term**: definition`` items (several terms may
    share one item: ``- **f**, **g**: ...``)."""
    section = text[text.index("## Glossary"):]
    found = {}
    for item in re.split(r"\n(?=- )", section):
        heads = re.match(r"- ((?:\*\*[^*]+\*\*(?: \([^)]*\))?(?:, )?)+):\s*(.*)", item, re.S)
        if heads:
            for term in re.findall(r"\*\*([^*]+)\*\*", heads.group(1)):
                found[term] = " ".join(heads.group(2).split())
    return found


def test_the_reading_path_names_every_idea_in_order():
    headings = re.findall(r"^## \d+\. (.+)$", READING.read_text(), re.M)
    ideas = ["backward", "ring all-reduce", "DDP", "ZeRO-1", "FSDP", "GPipe", "Megatron",
             "Sequence parallelism", "Recomputation", "reshard", "paged KV cache"]
    assert len(headings) == len(ideas), headings
    for heading, idea in zip(headings, ideas):
        assert idea.lower() in heading.lower(), f"expected the idea {idea!r} here, found the heading {heading!r}"
    assert len(entries(READING.read_text())) >= 2 * len(ideas)


def test_every_definition_on_the_reading_path_exists_and_fits_on_a_screen():
    broken = problems(READING.read_text())
    assert not broken, "docs/reading.md:\n  " + "\n  ".join(broken)


@pytest.mark.parametrize("entry, why", [
    ("`minitrain/comm/collectives.py:ring_all_reduce_v2`", "defines no ring_all_reduce_v2"),
    ("`minitrain/comm/nowhere.py:ring_all_reduce`", "no file minitrain/comm/nowhere.py"),
    ("`minitrain/parallel/fsdp.py:FullyShardedDataParallel`", "more than 80"),
    ("`minitrain/parallel/fsdp.py:_Unit.nothing`", "defines no _Unit.nothing"),
])
def test_a_broken_entry_is_named_with_its_line_and_reason(entry, why):
    found = problems(f"# path\n\n- {entry} — a sentence.\n")
    assert len(found) == 1 and found[0].startswith(f"docs/reading.md line 3: {entry}") and why in found[0], found


def test_methods_resolve_through_their_class_and_decorators_count():
    defs = definitions("class A:\n    @staticmethod\n    def f(x):\n        return x\n\ndef g():\n    def inner():\n        pass\n")
    assert defs == {"A": 4, "A.f": 3, "g": 3}


def test_the_glossary_defines_every_term_a_newcomer_meets():
    terms = glossary(READING.read_text())
    missing = [t for t in GLOSSARY_TERMS if t not in terms]
    assert not missing, f"docs/reading.md's glossary defines no {missing}"
    thin = [t for t in GLOSSARY_TERMS if len(terms[t].split()) < 8]
    assert not thin, f"glossary entries too short to define anything: {thin}"


def test_the_glossary_parser_reads_shared_items():
    text = "## Glossary\n\n- **f**, **g**: Megatron's two operators, f before and g after a layer.\n" \
           "- **Ψ** (psi): the number of parameters.\n"
    assert set(glossary(text)) == {"f", "g", "Ψ"}


def readme_problems(text):
    out = []
    lines = text.splitlines()
    if len(lines) > README_MAX_LINES:
        out.append(f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail to docs/")
    in_code = False
    for number, line in enumerate(lines, 1):
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#") and re.search(r"\bissues?\s*#?\d+|#\d+", line, re.I):
            out.append(f"README.md line {number}: a heading with an issue number: {line!r}")
    return out


def test_the_readme_is_short_and_its_headings_carry_no_issue_numbers():
    broken = readme_problems(README.read_text())
    assert not broken, "\n".join(broken)


def test_the_readme_check_catches_length_and_issue_headings():
    assert readme_problems("# minitrain\n## Run\n") == []
    assert "line 2" in readme_problems("# minitrain\n### GPU (issue 16, first part)\n")[0]
    assert readme_problems("x\n" * 351)[0].startswith("README.md has 351 lines")


def test_the_readme_keeps_the_lines_ci_runs():
    """.ci/run runs the first `pip install` line after the test-line marker; the run line is the README's promise."""
    text = README.read_text()
    after = text[text.index("<!-- test-line"):].splitlines()
    assert next(line for line in after if line.startswith("pip install")) == \
        'pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile'
    assert 'pip install -e ".[dev]" && mpirun -n 4 python -m minitrain.examples.mlp' in text.splitlines()


def test_the_readme_links_the_documents_it_points_to():
    text = README.read_text()
    for doc in ("docs/reading.md", "docs/architecture.md", "docs/measured.md"):
        assert f"]({doc}" in text, f"the README does not link {doc}"
        assert (ROOT / doc).is_file()
    for target in re.findall(r"\]\(((?:minitrain|docs|notebooks|scripts|tests)/[^)#\s]*)", text):
        assert (ROOT / target).exists(), f"the README links {target}, which does not exist"
    for page, anchor in re.findall(r"\]\(((?:docs/[\w.]+)?)#([\w-]+)\)", text):
        assert anchor in slugs((ROOT / page).read_text() if page else text), f"the README links {page}#{anchor}: no such heading"


def slugs(markdown):
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


def measured_problems(text):
    """docs/measured.md: each section says its command, device and date; no heading carries an issue number."""
    out = []
    for section in re.split(r"\n(?=## )", text)[1:]:
        heading = section.splitlines()[0]
        if re.search(r"\bissues?\s*#?\d+|#\d+", heading, re.I):
            out.append(f"{heading!r}: an issue number in a heading")
        meta = re.search(r"^Command: .+?Device: .+?Date: (\d{4}-\d\d-\d\d)", section, re.M | re.S)
        if not meta:
            out.append(f"{heading!r}: no 'Command: ... Device: ... Date: YYYY-MM-DD' line")
    return out


def test_every_measurement_names_its_command_device_and_date():
    text = (ROOT / "docs" / "measured.md").read_text()
    assert text.count("\n## ") >= 10
    broken = measured_problems(text)
    assert not broken, "docs/measured.md:\n  " + "\n  ".join(broken)


def test_the_measured_check_catches_a_section_without_a_date():
    assert measured_problems("# M\n\n## Ring\n\nCommand: `x`. Device: cpu. Date: 2026-11-22.\n") == []
    assert "no 'Command" in measured_problems("# M\n\n## Ring\n\nCommand: `x`. Device: cpu.\n")[0]
    assert "issue number" in measured_problems("# M\n\n## GPU (issue 16)\n\nCommand: a Device: b Date: 2026-01-01\n")[0]

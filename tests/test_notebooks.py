"""Every walkthrough notebook executes top to bottom, asserts what it teaches, and is listed in the
README. A failing cell fails the test, ``!`` shell commands included (run with ``pipefail``, so an
``!mpiexec ... | tail`` whose job fails fails too)."""
import pathlib
import re
import shutil
import tempfile

import pytest

from minitrain.testing import run_together

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Run first, hidden from the learner: IPython's ``!cmd`` ignores the command's exit status; this
# makes a failing command raise (bash -o pipefail: a pipeline fails if any part does).
CHECKED_SHELL = r'''
import subprocess as _subprocess
_ip = get_ipython()
def _checked_system(cmd):
    cmd = _ip.var_expand(cmd, depth=1)
    done = _subprocess.run(["bash", "-o", "pipefail", "-c", cmd], stdout=_subprocess.PIPE,
                           stderr=_subprocess.STDOUT, text=True)
    print(done.stdout, end="")
    _ip.user_ns["_exit_code"] = done.returncode
    if done.returncode:
        raise RuntimeError(f"!{cmd} exited with status {done.returncode}")
_ip.system = _ip.system_piped = _ip.system_raw = _checked_system
'''


# Also hidden: the notebook's temporary files (tempfile.mkdtemp, its jobs' TMPDIR) go to a directory the test
# removes, so that the learner's notebook can leave them to the system and the suite leaves none behind.
OWN_TMPDIR = """
import os as _os, tempfile as _tempfile
_tempfile.tempdir = _os.environ["TMPDIR"] = {tmp!r}
"""


def execute(path, nb):
    tmp = tempfile.mkdtemp(prefix=f"minitrain-{path.stem}-")
    try:
        _execute(path, nb, CHECKED_SHELL + OWN_TMPDIR.format(tmp=tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _execute(path, nb, prelude):
    nb.cells.insert(0, nbformat.v4.new_code_cell(prelude))
    for attempt in (1, 2):
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
            return
        except RuntimeError as e:
            # A kernel that dies before its first reply ran none of the notebook: its TCP ports, picked free a
            # moment before it binds them, were taken meanwhile (by the other kernel or an MPI job of the other
            # worker; seen once in CI). Start it once more; any other failure, or a second death, is the test's.
            if attempt == 2 or "Kernel died before replying to kernel_info" not in str(e):
                raise


@pytest.fixture(scope="module")
def executed(request):
    """The notebooks this session selected, executed two at a time, each in its own kernel (a kernel's start
    and a notebook's Python leave the second core idle): path -> (None, None) or (None, the exception it raised)."""
    wanted = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_runs"]
    return run_together({path: lambda p=path: execute(p, nbformat.read(p, as_version=4)) for path in wanted}, workers=2)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, executed):
    _, error = executed[path]
    if error is not None:
        raise error


def code_of(path):
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_notebook_asserts_what_it_teaches(path):
    asserts = re.findall(r"(?:^|;)\s*assert\b|np\.testing\.assert_", code_of(path), re.M)
    assert asserts, f"{path.name} asserts nothing: a walkthrough must check what it shows"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_cell_has_its_own_id(path):
    """nbformat 4.5 gives every cell an id (Jupyter's links and diffs use it); a cell written without one is
    a warning today and, nbformat says, a hard error in a future version."""
    import json
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), (path.name, ids)


def test_every_notebook_is_in_the_readme_and_every_readme_notebook_exists():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"notebooks/(\d\d_\w+\.ipynb)", readme))
    files = {p.name for p in NOTEBOOKS}
    assert named <= files, f"the README names missing notebooks: {sorted(named - files)}"
    assert files <= named, f"notebooks the README does not list: {sorted(files - named)}"


def test_a_failing_shell_command_fails_its_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("!echo fine | tail -1"),
                nbformat.v4.new_code_cell("!false | tail -1")]              # tail succeeds, false does not
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="exited with status 1"):
        execute(tmp_path / "probe.ipynb", nb)


def test_a_kernel_that_dies_before_its_first_reply_is_started_once_more(monkeypatch):
    """The notebook is run again only for a kernel that died at start (it ran none of it); twice is a failure,
    and so is any other error at once."""
    calls = []

    def dies(times, message="Kernel died before replying to kernel_info"):
        def execute(self):
            calls.append(1)
            if len(calls) <= times:
                raise RuntimeError(message)
        return execute
    nb = nbformat.v4.new_notebook()
    monkeypatch.setattr(nbclient.NotebookClient, "execute", dies(1))
    execute(ROOT / "notebooks" / "x.ipynb", nb)
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(nbclient.NotebookClient, "execute", dies(2))
    with pytest.raises(RuntimeError, match="Kernel died"):
        execute(ROOT / "notebooks" / "x.ipynb", nbformat.v4.new_notebook())
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(nbclient.NotebookClient, "execute", dies(1, "a cell failed"))
    with pytest.raises(RuntimeError, match="a cell failed"):
        execute(ROOT / "notebooks" / "x.ipynb", nbformat.v4.new_notebook())
    assert len(calls) == 1

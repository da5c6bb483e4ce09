"""The GPT job run in several layouts in one mpiexec launch per rank count, and its one-process references:
what test_five_axes.py and test_gpt_mixed_precision.py hold against each other."""
import json
import sys

import minitrain as mt


def run_layouts(d, job, launches, one_process, timeout=400):
    """``launches``: ranks -> {name: options added to ``job``}; ``one_process``: {name: options}. Returns
    ({layout name: its JSON}, {one-process name: its JSON}), the files written under ``d``."""
    from minitrain.examples import gpt
    from minitrain.testing import run_mpi
    from test_resume_guards import run
    reports, a = {}, [str(x) for x in job]
    for n, layouts in launches.items():
        calls = "; ".join(f"assert gpt.main(a + {[str(x) for x in extra]!r} + ['--json', {str(d / f'{n}_{k}.json')!r}])"
                          " == 0" for k, extra in enumerate(layouts.values()))
        run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; a = {a!r}; {calls}"], n=n, timeout=timeout)
        reports.update({name: json.loads((d / f"{n}_{k}.json").read_text()) for k, name in enumerate(layouts)})
    dtype = mt.get_default_dtype()                   # the job sets its dtype; a module fixture's is not restored
    one = {}
    try:
        for name, extra in one_process.items():
            status, _, err = run(gpt, job + extra + ["--json", d / f"one_{name}.json"])
            assert status == 0, err
            one[name] = json.loads((d / f"one_{name}.json").read_text())
    finally:
        mt.set_default_dtype(dtype)
    return reports, one

"""Several job runs in one mpiexec launch (run by tests/test_partial_batches.py): each line of
argv[2:] is "name|module|flags"; every run writes its --json report to argv[1]/<name>.json."""
import pathlib
import sys

from minitrain.examples import gpt, mlp

out = pathlib.Path(sys.argv[1])
for line in sys.argv[2:]:
    name, module, flags = line.split("|")
    status = {"mlp": mlp, "gpt": gpt}[module].main(flags.split() + ["--json", str(out / f"{name}.json")])
    assert status == 0, f"{name}: exit status {status}"
    print(f"{name}: done", flush=True)

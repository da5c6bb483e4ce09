"""The device suite: every job on the GPU (the strict CuPy stand-in, MINITRAIN_DEVICE=cuda) at 1, 2
and 4 ranks, its losses and accuracies compared with the same job on the CPU, rank r on GPU r.

The stand-in runs with CUPY_STANDIN_IMPLICIT=error (a conversion CuPy would make silently fails
the job) and CUPY_STANDIN_FORBID_DEVICE_POINTERS=1 (handing a device pointer to anyone, such as a
non-CUDA-aware MPI, fails the job). Tolerances: fp32/fp64 jobs agree with the CPU to 1e-4 relative
(measured: 1e-7 to 1e-5; the GPU's fused kernels round differently), bf16 and fp16 to 1e-2; test
accuracies to one test image in 100. GPT jobs with dropout draw their masks on the GPU (other
masks than the CPU's), so their losses are compared loosely (5%). One mpiexec launch per rank count;
the configurations live in tests/programs/device_suite.py (scripts/gpu_validate.sh runs them too).
"""
import json
import os
import pathlib
import sys

import pytest

from minitrain.testing import run_mpi

ROOT = pathlib.Path(__file__).parent.parent
STANDIN = ROOT / "tests" / "standin"
PROGRAM = ROOT / "tests" / "programs" / "device_suite.py"
sys.path.insert(0, str(PROGRAM.parent))
from device_suite import CONFIGS, compare, placement_problems  # noqa: E402


def suite_env(report_prefix):
    path = os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "CUPY_STANDIN_DEVICES": "4", "CUPY_STANDIN_IMPLICIT": "error",
            "CUPY_STANDIN_FORBID_DEVICE_POINTERS": "1", "CUPY_STANDIN_REPORT": str(report_prefix)}


def run_suite(tmp_path, n):
    run_mpi([sys.executable, PROGRAM, tmp_path], n=n, timeout=240, env=suite_env(tmp_path / "standin"))
    return json.loads((tmp_path / f"suite.{n}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_job_on_the_gpu_matches_the_cpu_and_rank_r_uses_gpu_r(tmp_path, n):
    results = run_suite(tmp_path, n)
    by_name = {c["name"]: c for c in CONFIGS}
    assert {e["name"] for e in results} == {c["name"] for c in CONFIGS if n in c["ranks"]}
    for entry in results:
        assert compare(entry, by_name[entry["name"]]) == [], entry["name"]
        assert placement_problems(entry, n, devices=4) == [], entry["name"]

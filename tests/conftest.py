import os
import sys
import tempfile

# Every rank a test launches (about 900 processes a run) imports minitrain afresh. Where bytecode is not
# written (PYTHONDONTWRITEBYTECODE, as on the CI machine) each one compiled every module it imports again,
# ~0.15 s of CPU a process, a fifth of the suite's. The tests and the processes they start cache bytecode
# outside the tree instead (Python checks each cached file against its source's mtime and size).
os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"minitrain-pycache-{os.getuid()}"))
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import minitrain  # noqa: E402
from minitrain import backend  # noqa: E402

# Under pytest-xdist (the README's test line runs two workers) each worker shares the cores with the
# other: a test that trains in this process would take a BLAS thread per core and wait on threads the
# other worker keeps off the cores (a 2 s GPT test took 60 s). Each worker keeps to its share, as a rank
# does (backend.limit_blas_threads), and the jobs and notebook kernels its tests start inherit it.
# For the same reason a waiting rank of a job the tests start sleeps at once instead of polling with
# sched_yield first (MINITRAIN_COMM_YIELD_S, comm/communicator.py): the core it would poll on is the other
# worker's (the whole suite on 2 cores: 593 -> 481 s; the jobs' own default, 10 ms, is for their own cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = backend.default_blas_threads(ranks=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.update({var: str(_share) for var in backend.BLAS_THREAD_VARS})
    backend.limit_blas_threads(_share)
    os.environ.setdefault("MINITRAIN_COMM_YIELD_S", "0")


@pytest.fixture
def float64():
    """Run the test with float64 as the default dtype (oracle tests compare at 1e-10)."""
    old = minitrain.get_default_dtype()
    minitrain.set_default_dtype(np.float64)
    minitrain.manual_seed(0)
    yield
    minitrain.set_default_dtype(old)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    """A test that sets the default dtype (many switch to float64 inside ThreadWorld workers) must
    not change it for the tests after it."""
    old = minitrain.get_default_dtype()
    yield
    minitrain.set_default_dtype(old)


STANDIN = __import__("pathlib").Path(__file__).parent / "standin"


@pytest.fixture
def standin_gpu():
    """The strict CuPy stand-in (tests/standin) as this test's GPU, in strict mode: an implicit
    conversion or a device pointer request raises. Yields the stand-in ``cupy`` with zeroed
    counters; afterwards the device is the CPU again. Skipped where a real CuPy is loaded."""
    import sys
    loaded = sys.modules.get("cupy")
    if loaded is not None and not getattr(loaded, "__standin__", False):
        pytest.skip("a real CuPy is loaded in this process")
    if str(STANDIN) not in sys.path:
        sys.path.insert(0, str(STANDIN))
    import cupy
    from minitrain import backend
    if not getattr(cupy, "__standin__", False):
        pytest.skip("a real CuPy is installed: the stand-in runs in the device suite's subprocesses")
    standin = cupy._standin
    old = standin.IMPLICIT, standin.FORBID_DEVICE_POINTERS
    standin.IMPLICIT, standin.FORBID_DEVICE_POINTERS = "error", True
    backend.set_device("cuda")
    backend.use_gpu(0)
    standin.reset()
    try:
        yield cupy
    finally:
        backend.set_device("cpu")
        standin.set_current_device(0)
        standin.IMPLICIT, standin.FORBID_DEVICE_POINTERS = old

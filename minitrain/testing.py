"""Test helpers shared by the test suite and the exercise checks.

gradcheck compares backward() with central differences (float64).
run_mpi runs a command under mpiexec -n N (MPICH's or Open MPI's) with a hard timeout;
every output line is prefixed with its rank (-l / --tag-output), and a failure or a hang
raises MPIRunError carrying all of it, so a deadlock fails a test within its timeout instead of
stalling CI.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from .autograd import Tensor


def numerical_grad(f, array, eps=1e-6):
    """Central differences of the scalar ``f()`` w.r.t. every entry of ``array`` (modified in place)."""
    grad = np.zeros(array.shape, dtype=np.float64)
    flat, gflat = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = f()
        flat[i] = old - eps
        minus = f()
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return grad


def gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, seed=0):
    """Check ``fn(*inputs)`` (inputs: float64 Tensors; those with requires_grad are checked).
    The output is reduced to a scalar with a fixed random projection, so every output entry matters.
    Returns the largest absolute error; raises AssertionError naming the input that disagrees."""
    out = fn(*inputs)
    projection = np.random.default_rng(seed).standard_normal(out.shape)

    def scalar():
        return float((fn(*inputs).numpy() * projection).sum())

    for t in inputs:
        if isinstance(t, Tensor):
            t.grad = None
    (out * Tensor(projection)).sum().backward()
    worst = 0.0
    for k, t in enumerate(inputs):
        if not (isinstance(t, Tensor) and t.requires_grad):
            continue
        expected = numerical_grad(scalar, t.data, eps)
        got = np.zeros_like(expected) if t.grad is None else np.asarray(t.grad)
        err = np.abs(got - expected)
        worst = max(worst, float(err.max(initial=0.0)))
        if not np.allclose(got, expected, atol=atol, rtol=rtol):
            i = np.unravel_index(np.argmax(err), err.shape)
            raise AssertionError(f"gradcheck: input {k} (shape {t.shape}) differs at {i}: "
                                 f"backward {got[i]!r}, central difference {expected[i]!r}")
    return worst


def median_time(fn, repeats, warmup=1):
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones (benchmarks)."""
    import statistics
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class MPIRunError(AssertionError):
    """An mpiexec run failed or timed out; the message holds every rank's output."""


def mpiexec_path():
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


_FLAVOR = {}


def launcher_args(mpiexec, n, label=False):
    """``-n n`` plus what the launcher needs: Open MPI's mpirun refuses root without
    --allow-run-as-root and more ranks than cores without --oversubscribe, and labels output with
    --tag-output where MPICH's hydra takes -l."""
    if mpiexec not in _FLAVOR:
        try:
            version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
            text = version.stdout + version.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        _FLAVOR[mpiexec] = "openmpi" if ("Open MPI" in text or "OpenRTE" in text) else "mpich"
    if _FLAVOR[mpiexec] == "openmpi":
        extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
        return ["-n", str(n)] + extra + (["--tag-output"] if label else [])
    return ["-n", str(n)] + (["-l"] if label else [])


def run_worker(script, n, args=(), timeout=1800):
    """Benchmarks: run ``script --worker-out PATH *args`` under ``mpiexec -n n`` with one BLAS thread
    per rank (its stdout discarded) and return the JSON that rank 0 wrote to PATH."""
    out = os.path.join(tempfile.gettempdir(), f"minitrain_worker_{os.getpid()}_{time.monotonic_ns()}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    mpiexec = mpiexec_path()
    cmd = [mpiexec, *launcher_args(mpiexec, n), sys.executable, str(script), "--worker-out", out, *map(str, args)]
    subprocess.run(cmd, check=True, env=env, timeout=timeout, stdout=subprocess.DEVNULL)
    try:
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def free_port():
    """A TCP port free on 127.0.0.1 right now (PyTorch's gloo rendezvous in the benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mpi(args, n, timeout=120, env=None, cwd=None, check=True):
    """Run ``mpiexec -n n -l args...``; returns the CompletedProcess (stdout and stderr merged).
    Ranks get OMP_NUM_THREADS=1 / OPENBLAS_NUM_THREADS=1 so they do not fight over the cores."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise MPIRunError("mpiexec not found: pip install mpich (or pip install -e '.[dev]')")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": str(int(timeout)), **(env or {})}
    # not PYTHONUNBUFFERED: unbuffered print() writes a line in pieces and -l labels every piece;
    # code that must show output before a hang prints with flush=True (one write per line)
    full_env.pop("PYTHONUNBUFFERED", None)
    cmd = [mpiexec, *launcher_args(mpiexec, n, label=True), *[str(a) for a in args]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise MPIRunError(f"timed out after {timeout} s: {' '.join(cmd)}\n--- output of every rank ---\n{out}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise MPIRunError(f"exit code {proc.returncode}: {' '.join(cmd)}\n"
                          f"--- output of every rank ---\n{out}")
    return result


# ---------------------------------------------------------------- collective checks
# Integer-valued floats make every order of additions exact, so results must agree bit for bit.
COLLECTIVE_DTYPES = ("float32", "float64", "int32", "int64", "float16")


def collective_lengths(p):
    """0, 1, fewer than p, not divisible by p, and a few thousand."""
    return sorted({0, 1, max(p - 1, 1), 7, 13 * p + 1, 4099})


def rank_input(rank, n, dtype, seed=0):
    """Rank ``rank``'s input: integers in [-50, 50) as ``dtype`` (every rank can rebuild everyone's)."""
    rng = np.random.default_rng([seed, rank, n])
    return rng.integers(-50, 50, n).astype(dtype)


def expected_reduction(p, n, dtype, op, seed=0):
    stack = np.stack([rank_input(r, n, dtype, seed) for r in range(p)]).astype(np.float64)
    result = {"sum": stack.sum(0), "mean": stack.mean(0), "max": stack.max(0), "min": stack.min(0)}[op]
    return result.astype(dtype)


def _mpi_reference(mpi_comm, x, op):
    """MPI's built-in Allreduce, for the dtypes and ops MPI has."""
    from mpi4py import MPI
    if x.dtype == np.float16 or op == "mean":
        return None
    out = np.empty_like(x)
    mpi_comm.Allreduce(x, out, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
    return out


def check_all_reduce(comm, impl, ops=("sum", "mean", "max", "min"), dtypes=COLLECTIVE_DTYPES,
                     lengths=None, mpi_comm=None, name="all_reduce"):
    """Run ``impl(comm, x, op=op)`` on every (length, dtype, op) and compare exactly with the
    NumPy oracle (and MPI_Allreduce when ``mpi_comm`` is given). Returns the number of checks."""
    count = 0
    for n in lengths or collective_lengths(comm.size):
        for dtype in dtypes:
            for op in ops:
                if op == "mean" and np.dtype(dtype).kind != "f":
                    continue
                x = rank_input(comm.rank, n, dtype)
                before = x.copy()
                got = impl(comm, x, op=op)
                want = expected_reduction(comm.size, n, dtype, op)
                where = f"[rank {comm.rank}] {name} p={comm.size} n={n} {dtype} op={op}"
                assert np.array_equal(x, before), f"{where}: the input was modified"
                assert got.dtype == x.dtype and got.shape == x.shape, f"{where}: got {got.dtype}{got.shape}"
                assert np.array_equal(got, want), f"{where}: wrong result {got[:8]} vs {want[:8]}"
                if mpi_comm is not None:
                    ref = _mpi_reference(mpi_comm, x, op)
                    if ref is not None:
                        assert np.array_equal(got, ref), f"{where}: differs from MPI_Allreduce"
                count += 1
    return count

"""Test helpers shared by the test suite and the exercise checks.

gradcheck compares backward() with central differences (float64).
run_mpi runs a command under mpiexec -n N with a hard timeout; every output line is
prefixed with its rank ([r] : MPICH's -l, Open MPI's --tag-output rewritten to the same
form), and a failure or a hang raises MPIRunError carrying all of it, so a deadlock fails a test
within its timeout instead of stalling CI. The launcher is the one that belongs to the MPI library
mpi4py loads (mpi_launcher): the mpich wheel's mpiexec (hydra) or Open MPI's mpirun.
"""
import json
import os
import re
import resource
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


_PROBE = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
          "print(MPI.Get_library_version().splitlines()[0]); "
          "print(next((l.split()[-1] for l in open('/proc/self/maps') if 'libmpi' in l and '.so' in l), ''))")
_LAUNCHER = None
_LIBRARY = None


def mpi_launcher():
    """(path, flavor) of the launcher that matches the MPI library mpi4py loads: flavor "mpich"
    (hydra's mpiexec: the mpich wheel's beside this Python first) or "openmpi" (mpirun). Asked
    once, in a subprocess (importing mpi4py here would initialise MPI in the test process)."""
    global _LAUNCHER, _LIBRARY
    if _LAUNCHER is None:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        library, _, lib_path = (probe.stdout.strip() + "\n\n").partition("\n")
        _LIBRARY = " ".join(library.split()) or "unknown (mpi4py did not load)"
        lib_path = lib_path.strip()
        root = os.path.dirname(os.path.dirname(lib_path)) if lib_path else ""
        if "open mpi" in library.lower():
            names = [os.path.join(root, "bin", "mpirun"), shutil.which("mpirun.openmpi"), shutil.which("mpirun")]
            flavor = "openmpi"
        else:
            names = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), os.path.join(root, "bin", "mpiexec"),
                     shutil.which("mpiexec.hydra"), shutil.which("mpiexec")]
            flavor = "mpich"
        path = next((c for c in names if c and os.path.exists(c)), None)
        _LAUNCHER = (path, flavor)
    return _LAUNCHER


def mpi_library_name():
    """The MPI library the benchmarks' workers run on: MPI_Get_library_version's first line, asked
    of the same mpi4py in a subprocess (for the tables; never a fixed string)."""
    mpi_launcher()
    return _LIBRARY


def mpiexec_path():
    """The launcher that matches mpi4py's MPI (see mpi_launcher)."""
    return mpi_launcher()[0]


def mpiexec_command(n=None, label=False):
    """``[launcher, -n, N, flags...]`` for this machine's MPI (no ``-n`` when ``n`` is None: the
    notebooks write ``{mpiexec} -n 4 ...``). ``label``: prefix output lines with the rank (MPICH
    ``-l``, Open MPI ``--tag-output``). Open MPI also gets ``--oversubscribe`` (more ranks than
    cores, as in the tests) and, as root, ``--allow-run-as-root``."""
    path, flavor = mpi_launcher()
    if path is None:
        raise MPIRunError("mpiexec not found: pip install mpich (or pip install -e '.[dev]'), or install the "
                          "launcher of the MPI mpi4py was built for")
    return [path] + _flags(flavor, n, label)


_OMPI_TAG = re.compile(r"^\[\d+,(\d+)\]<(?:stdout|stderr)>:\s?", re.M)


def _normalise_labels(text):
    """Open MPI's ``[1,3]<stdout>:line`` becomes MPICH's ``[3] line``."""
    return _OMPI_TAG.sub(lambda m: f"[{m.group(1)}] ", text)


def _flags(flavor, n, label):
    """``-n n`` (none when n is None) plus what the launcher needs: Open MPI's mpirun refuses root
    without --allow-run-as-root and more ranks than cores without --oversubscribe, and labels output
    with --tag-output where MPICH's hydra takes -l."""
    args = [] if n is None else ["-n", str(n)]
    if flavor == "openmpi":
        args += ["--oversubscribe"] + (["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])
        return args + (["--tag-output"] if label else [])
    return args + (["-l"] if label else [])


_FLAVOR = {}


def launcher_args(mpiexec, n, label=False):
    """``_flags`` for a given launcher path, its flavor asked of ``mpiexec --version``."""
    if mpiexec not in _FLAVOR:
        try:
            version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
            text = version.stdout + version.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        _FLAVOR[mpiexec] = "openmpi" if ("Open MPI" in text or "OpenRTE" in text) else "mpich"
    return _flags(_FLAVOR[mpiexec], n, label)


def busy_seconds():
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)        # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu():
    """CPU seconds of this process and of its children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + time.process_time()


def with_others_share(fn):
    """(fn(), the share of the cores that other processes used meanwhile: NaN where /proc/stat is missing)."""
    busy, mine, start = busy_seconds(), _own_cpu(), time.perf_counter()
    result = fn()
    wall, ours = time.perf_counter() - start, _own_cpu() - mine
    if busy is None:
        return result, float("nan")
    return result, max(0.0, (busy_seconds() - busy - ours) / (wall * (os.cpu_count() or 1)))


def wait_for_quiet(share, timeout, window=2.0):
    """Benchmarks: sample the machine over ``window`` s until other processes use less than ``share`` of
    its cores (or ``timeout`` s pass); returns the last share seen."""
    deadline = time.perf_counter() + timeout
    while True:
        _, others = with_others_share(lambda: time.sleep(window))
        if not others >= share or time.perf_counter() > deadline:      # (NaN: no /proc/stat, no waiting)
            return others


def run_worker(script, n, args=(), timeout=1800):
    """Benchmarks: run ``script --worker-out PATH *args`` under ``mpiexec -n n`` with one BLAS thread
    per rank (its stdout discarded) and return the JSON that rank 0 wrote to PATH."""
    out = os.path.join(tempfile.gettempdir(), f"minitrain_worker_{os.getpid()}_{time.monotonic_ns()}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [*mpiexec_command(n), sys.executable, str(script), "--worker-out", out, *map(str, args)]
    try:
        subprocess.run(cmd, check=True, env=env, timeout=timeout, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)
    finally:                                    # also after a worker that wrote its file and then failed
        if os.path.exists(out):
            os.unlink(out)


def run_together(jobs, workers):
    """{key: fn()} run ``workers`` at a time on threads (for jobs that leave the cores idle: a kernel
    starting, a job asleep until a timeout): key -> (its result, None) or (None, the exception it raised)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=workers) as pool:
        runs = {key: pool.submit(fn) for key, fn in jobs.items()}
    return {key: (None, run.exception()) if run.exception() else (run.result(), None) for key, run in runs.items()}


def free_port():
    """A TCP port free on 127.0.0.1 right now (PyTorch's gloo rendezvous in the benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close_gloo(dist):
    """Tear down a torch.distributed gloo group started under mpiexec (the benchmarks' PyTorch side).

    gloo aborts the process ("terminate called without an active exception") when a peer, or rank
    0's TCP store, goes away while this rank still tears down: agree, tear down, then agree again
    over MPI so that no rank exits before every rank has finished."""
    dist.barrier()
    dist.destroy_process_group()
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()


def run_mpi(args, n, timeout=120, env=None, cwd=None, check=True):
    """Run ``mpiexec -n n -l args...`` (Open MPI: ``mpirun -n n --tag-output``); returns the
    CompletedProcess (stdout and stderr merged, every line labelled ``[rank] ``). Ranks get
    OMP_NUM_THREADS=1 / OPENBLAS_NUM_THREADS=1 so they do not fight over the cores."""
    launcher = mpiexec_command(n, label=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": str(int(timeout)), **(env or {})}
    # not PYTHONUNBUFFERED: unbuffered print() writes a line in pieces and -l labels every piece;
    # code that must show output before a hang prints with flush=True (one write per line)
    full_env.pop("PYTHONUNBUFFERED", None)
    if mpi_launcher()[1] == "openmpi" and os.geteuid() == 0:
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [*launcher, *[str(a) for a in args]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out = _normalise_labels(out)
        raise MPIRunError(f"timed out after {timeout} s: {' '.join(cmd)}\n--- output of every rank ---\n{out}")
    out = _normalise_labels(out)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise MPIRunError(f"exit code {proc.returncode}: {' '.join(cmd)}\n"
                          f"--- output of every rank ---\n{out}")
    return result

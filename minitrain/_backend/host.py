"""The host a rank runs on: its place among the ranks on this machine, the cores it may run on, the BLAS
threads it may take, and host memory kept between steps instead of given back to the OS.
"""
import os
import sys

import numpy as np


def local_rank():
    """This process's rank among those the MPI launcher put on this machine (MPICH's
    MPI_LOCALRANKID, Open MPI's OMPI_COMM_WORLD_LOCAL_RANK; 0 when not launched by one)."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def launch_info():
    """(rank, size) of this process in the MPI launcher's world (MPICH's PMI_RANK / PMI_SIZE, Open MPI's
    OMPI_COMM_WORLD_*), read before any MPI starts; (0, 1) when started directly."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ.get(size_var, "1"))
    return 0, 1


def local_rank_count():
    """How many ranks the MPI launcher put on this machine (1 when not launched by one)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if var in os.environ:
            return max(1, int(os.environ[var]))
    return 1


def usable_cores():
    """The cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def default_blas_threads(ranks=None, cores=None, environ=None):
    """BLAS threads a rank takes: the cores it may run on / the ranks on this machine, never more than
    OMP_NUM_THREADS (or OPENBLAS_ / MKL_NUM_THREADS) asks for, as PyTorch keeps to it. (The planner
    predicts with the same rule.) The cores are the process's affinity, not the machine's: a launcher
    that binds each rank to a core (Open MPI does for 2 ranks) leaves it one thread, not cores / ranks
    on that one core."""
    environ = os.environ if environ is None else environ
    threads = max(1, (cores or usable_cores()) // (ranks or local_rank_count()))
    for var in BLAS_THREAD_VARS:
        value = environ.get(var, "").strip()
        if value.isdigit() and int(value) >= 1:
            threads = min(threads, int(value))
    return threads


def limit_blas_threads(threads=None):
    """Cap BLAS/OpenMP threads in this process (default: ``default_blas_threads()``).
    Ranks that each start one BLAS thread per core fight over the cores: measured here, 4 ranks on
    2 cores made a digits-MLP run 30x slower until each rank kept to its share. An OMP_NUM_THREADS=1
    in the environment is kept (the tests' mpiexec sets it): raising it to 2 for a 1-rank job made a
    GPT step's own thread spend 1 s instead of 20 ms waiting for a second BLAS thread that the other
    jobs on a shared 2-core machine kept off the cores. Without threadpoolctl (an optional dependency)
    nothing is capped: set OMP_NUM_THREADS instead."""
    if threads is None:
        threads = default_blas_threads()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=threads)


HELD_ARRAY_BYTES = 32 << 20       # host arrays up to this size come from the held heap (glibc's own maximum)


def hold_host_memory():
    """Keep freed host memory for the next step instead of giving it back to the OS (glibc malloc: a fixed
    trim threshold of 1 GiB and arrays up to 32 MiB from the heap: ``mallopt(M_TRIM_THRESHOLD / M_MMAP_THRESHOLD)``),
    as CuPy's memory pool does on the GPU. By default glibc adapts both to what the process freed before,
    so a step's cost depended on the process's history: measured here, the gpt job's default step took 16 ms
    of CPU in the job and 24 ms in a script that built the same model, whose every step gave its activations
    back at backward and touched them as new pages at the next forward (2,000 page faults, ~3 us each on this
    VM); held, both take 16 ms.
    Returns whether it took effect (glibc only; elsewhere the allocator is left as it is)."""
    global _host_memory_held
    if _host_memory_held or not sys.platform.startswith("linux"):
        return _host_memory_held
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        _host_memory_held = bool(libc.mallopt(m_trim_threshold, 1 << 30) and
                                 libc.mallopt(m_mmap_threshold, HELD_ARRAY_BYTES))
    except (OSError, AttributeError):
        _host_memory_held = False
    return _host_memory_held


_host_memory_held = False


def blas_threads():
    """The threads of the BLAS NumPy's products run on (threadpoolctl's count; None without it). Other BLAS
    libraries a process loads later (SciPy's, pulled in with scikit-learn's digits loader after the job
    capped its threads) do none of the job's arithmetic and are not counted; where NumPy's own cannot be
    told apart (a system BLAS), the most threads of any."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    blas = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    numpy_dir = os.path.dirname(np.__file__)
    own = [p for p in blas if os.path.dirname(p["filepath"]) in (numpy_dir + ".libs", os.path.join(numpy_dir, ".libs"))]
    counts = [p["num_threads"] for p in (own or blas)]
    return max(counts) if counts else None

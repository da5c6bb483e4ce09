"""The array module: NumPy on the CPU, CuPy on a CUDA GPU, behind one switch (as in needle).

Every tensor holds an xp array. Code never imports cupy outside this file; it asks
array_module(a) for the module that owns an array, or xp() for the module of the current
device. MINITRAIN_DEVICE=cuda (or minitrain.set_device("cuda")) selects CuPy;
use_gpu(i) picks the GPU (minitrain.comm.init() gives rank r its local rank's).
Moves between host and device happen only here, on purpose, and are counted (transfer_counts):
host -> device copies, device -> host copies, and synchronisations (the host waiting for the GPU).
The default floating dtype is float32, as in PyTorch; set_default_dtype(np.float64) switches it.
"""
import os
import sys
import threading

import numpy as np

try:                                   # bfloat16 for NumPy (the package JAX uses)
    from ml_dtypes import bfloat16
except ImportError:                    # pragma: no cover - ml_dtypes is a dependency
    bfloat16 = None

#: the 16-bit floating dtypes mixed precision computes in
LOW_PRECISION = tuple(np.dtype(d) for d in (np.float16, bfloat16) if d is not None)

_cupy = None          # the cupy module, once imported
_device = "cpu"
_gpu = 0              # the GPU this process computes on (each thread makes it current: bind_thread)
_default_dtype = np.dtype(np.float32)


def _import_cupy():
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("device 'cuda' needs CuPy: pip install -e '.[gpu]'") from e
        _cupy = cupy
    return _cupy


def set_device(name):
    """Select where new tensors live: 'cpu' (NumPy) or 'cuda' (CuPy)."""
    global _device
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: expected 'cpu' or 'cuda'")
    if name == "cuda":
        _import_cupy()
    _device = name


def get_device():
    return _device


def cuda_available():
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        cupy = _import_cupy()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# ---------------------------------------------------------------- which GPU
def gpu_count():
    return _import_cupy().cuda.runtime.getDeviceCount()


def use_gpu(index):
    """Compute on GPU ``index`` from now on (this thread now; other threads through bind_thread)."""
    global _gpu
    count = gpu_count()
    if not 0 <= index < count:
        raise ValueError(f"GPU {index} does not exist: this machine has {count}")
    _gpu = index
    bind_thread()


def bind_thread():
    """Make this process's GPU current for the calling thread (a new thread starts on GPU 0, as
    with the CUDA runtime: a progress thread must call this before it touches device arrays)."""
    if _device == "cuda":
        _cupy.cuda.Device(_gpu).use()


def gpu_index():
    return _gpu


def describe_device():
    """'cpu' or 'cuda:1 (NVIDIA H100 80GB HBM3)': what the job's table prints."""
    if _device != "cuda":
        return "cpu"
    name = _cupy.cuda.runtime.getDeviceProperties(_gpu)["name"]
    return f"cuda:{_gpu} ({name.decode() if isinstance(name, bytes) else name})"


def xp():
    """The array module of the current device."""
    return _cupy if _device == "cuda" else np


def array_module(a):
    """The array module (numpy or cupy) that owns array ``a``."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy
    return np


def is_device_array(a):
    return _cupy is not None and isinstance(a, _cupy.ndarray)


# ---------------------------------------------------------------- counted moves
class _Counts(threading.local):
    def __init__(self):
        self.h2d = self.h2d_bytes = self.d2h = self.d2h_bytes = self.sync = 0


_counts = _Counts()


def transfer_counts():
    """This thread's deliberate moves so far: h2d / d2h (copies and bytes) and sync."""
    c = _counts
    return {"h2d": c.h2d, "h2d_bytes": c.h2d_bytes, "d2h": c.d2h, "d2h_bytes": c.d2h_bytes, "sync": c.sync}


def to_host(a):
    """A NumPy copy of a device array (counted: a blocking copy, so also a synchronisation);
    a host array itself."""
    if is_device_array(a):
        _counts.d2h += 1
        _counts.d2h_bytes += a.nbytes
        _counts.sync += 1
        return _cupy.asnumpy(a)
    return np.asarray(a)


def to_device(a, device=None):
    """``a`` on ``device`` (default: the current one); a host -> device copy is counted."""
    device = device or _device
    if device == "cuda":
        if not is_device_array(a):
            a = np.asarray(a)
            _counts.h2d += 1
            _counts.h2d_bytes += a.nbytes
        return _import_cupy().asarray(a)
    return to_host(a)


def to_host_into(a, out, blocking=True):
    """Copy device array ``a`` into the host array ``out`` of the same shape and dtype (counted). Into
    pinned memory with ``blocking=False`` the copy is queued on the stream: synchronize() before reading."""
    _counts.d2h += 1
    _counts.d2h_bytes += a.nbytes
    _counts.sync += bool(blocking)
    a.get(out=out, blocking=blocking)
    return out


def to_device_into(out, host):
    """Copy the host array ``host`` into device array ``out`` (counted; queued on the stream)."""
    _counts.h2d += 1
    _counts.h2d_bytes += host.nbytes
    out.set(host)
    return out


def to_scalar(a):
    """A Python number from a one-element array (on the device: a counted copy and synchronisation)."""
    if is_device_array(a):
        _counts.d2h += 1
        _counts.d2h_bytes += a.nbytes
        _counts.sync += 1
    return a.item()


def synchronize():
    """Wait for queued GPU work (a no-op on the CPU). Call before timing or before MPI reads a buffer."""
    if _cupy is not None and _device == "cuda":
        _counts.sync += 1
        _cupy.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------- kernels, randomness, events
def scatter_add(out, indices, values):
    """out[indices] += values, adding where an index repeats (np.add.at / cupyx.scatter_add)."""
    if is_device_array(out):
        import cupyx
        cupyx.scatter_add(out, indices, values)
    else:
        np.add.at(out, indices, values)


#: fused kernels on (MINITRAIN_FUSE=0: every fused function runs as its separate operations, to
#: measure what fusion saves)
FUSE = os.environ.get("MINITRAIN_FUSE", "1") != "0"


class _Fused:
    """``cupy.fuse`` of ``make(cupy)``: one kernel per call. Should CuPy fail to compile it for some
    argument types (its fusion knows fewer dtypes than its ufuncs), the same function runs unfused
    (one kernel per operation) and that is said once on stderr."""

    def __init__(self, make, name):
        self.make, self.name = make, name
        self.fused = self.plain = None
        self.unfusable = set()
        FUSED.append(self)

    def __call__(self, *args):
        if self.fused is None:
            cupy = _import_cupy()
            self.plain = self.make(cupy)
            self.fused = cupy.fuse(kernel_name=self.name)(self.plain)
        key = tuple((a.dtype.str, a.ndim) if hasattr(a, "ndim") else type(a) for a in args)
        if FUSE and key not in self.unfusable:
            try:
                return self.fused(*args)
            except Exception as e:
                if getattr(_cupy, "__standin__", False):      # the stand-in ran it eagerly: a real bug
                    raise
                self.unfusable.add(key)
                sys.stderr.write(f"minitrain: cupy.fuse could not compile {self.name} for {key} "
                                 f"({type(e).__name__}: {e}); running it unfused\n")
        return self.plain(*args)


#: every fused kernel made so far (``unfusable``: the argument types CuPy could not compile it for)
FUSED = []


def fuse(make, name):
    """A fused elementwise kernel for device arrays: ``make(xp)`` returns a function of arrays and
    Python scalars written with xp's ufuncs (what cupy.fuse compiles)."""
    return _Fused(make, name)


class _ElementwiseKernel(_Fused):
    """One ``cupy.ElementwiseKernel`` written in CUDA C (``in_params``, ``out_params``, ``operation``)
    for updates in place, whose arguments are the kernel's (inputs, then the arrays it updates). The
    CuPy stand-in cannot compile C: there, and with MINITRAIN_FUSE=0, ``make(xp)`` (the same update
    in xp's ufuncs) runs instead, through cupy.fuse as the other kernels do, so CI checks the
    arithmetic and the GPU test checks that the C says the same (tests/test_gpu.py)."""

    def __init__(self, make, name, in_params, out_params, operation):
        super().__init__(make, name)
        self.spec = (in_params, out_params, operation)
        self.kernel = None

    def __call__(self, *args):
        if not FUSE or getattr(_import_cupy(), "__standin__", False):
            return super().__call__(*args)
        key = ("C",) + tuple(a.dtype.str for a in args if hasattr(a, "dtype"))
        if key not in self.unfusable:
            try:
                if self.kernel is None:
                    self.kernel = _cupy.ElementwiseKernel(*self.spec, name=self.name)
                return self.kernel(*args)
            except Exception as e:          # e.g. a dtype CUDA C has no sqrt for: say so, run the ufuncs
                self.unfusable.add(key)
                sys.stderr.write(f"minitrain: ElementwiseKernel {self.name} failed for {key[1:]} "
                                 f"({type(e).__name__}: {e}); running it through cupy.fuse\n")
        return super().__call__(*args)


def elementwise_kernel(make, name, in_params, out_params, operation):
    """An in-place elementwise update as one CUDA kernel (see _ElementwiseKernel)."""
    return _ElementwiseKernel(make, name, in_params, out_params, operation)


_rng = threading.local()   # .states: GPU index -> this thread's cuRAND Philox generator


def device_uniform(shape, seed, dtype):
    """Uniform [0, 1) numbers drawn on the GPU by cuRAND's Philox from ``seed`` (a counter-based
    generator: reseeding costs nothing, so every draw takes its seed from the host generator and
    recomputation replays it)."""
    cupy = _cupy
    states = getattr(_rng, "states", None)
    if states is None:
        states = _rng.states = {}
    state = states.get(_gpu)
    if state is None:
        state = states[_gpu] = cupy.random.RandomState(seed, method=cupy.cuda.curand.CURAND_RNG_PSEUDO_PHILOX4_32_10)
    else:
        state.seed(seed)
    return state.random_sample(shape, dtype=np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def record_event():
    """A CUDA event recorded now on the current stream (None on the CPU): trace spans time the GPU."""
    if _device != "cuda":
        return None
    event = _cupy.cuda.Event()
    event.record()
    return event


def elapsed_ms(start, end, wait=True):
    """Milliseconds between two recorded events; waits for ``end`` first (a counted synchronisation)
    unless the caller already waited for a later event."""
    if wait:
        _counts.sync += 1
        end.synchronize()
    return _cupy.cuda.get_elapsed_time(start, end)


# ---------------------------------------------------------------- memory views
def address(a):
    """The address of ``a``'s first element (device pointers only through CuPy's MemoryPointer,
    never by converting the array)."""
    return a.data.ptr if is_device_array(a) else a.__array_interface__["data"][0]


def byte_offset(view, base):
    """Where ``view``'s first element lies in ``base``'s memory, in bytes."""
    return address(view) - address(base)


def view_of(base, shape, dtype, offset, strides):
    """The array of ``shape``/``strides`` at byte ``offset`` inside ``base``'s memory."""
    if is_device_array(base):
        return _cupy.ndarray(shape, dtype, memptr=base.data + offset, strides=strides)
    return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)


# ---------------------------------------------------------------- host threads and dtypes
def local_rank():
    """This process's rank among those the MPI launcher put on this machine (MPICH's
    MPI_LOCALRANKID, Open MPI's OMPI_COMM_WORLD_LOCAL_RANK; 0 when not launched by one)."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def local_rank_count():
    """How many ranks the MPI launcher put on this machine (1 when not launched by one)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if var in os.environ:
            return max(1, int(os.environ[var]))
    return 1


BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def default_blas_threads(ranks=None, cores=None, environ=None):
    """BLAS threads a rank takes: cores / ranks on this machine, never more than OMP_NUM_THREADS (or
    OPENBLAS_ / MKL_NUM_THREADS) asks for, as PyTorch keeps to it. (The planner predicts with the same rule.)"""
    environ = os.environ if environ is None else environ
    threads = max(1, (cores or os.cpu_count() or 1) // (ranks or local_rank_count()))
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


def set_default_dtype(dtype):
    """The floating dtype of new tensors and parameters (float32 unless changed)."""
    global _default_dtype
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"default dtype must be a floating type, got {dtype}")
    _default_dtype = dtype


def get_default_dtype():
    return _default_dtype


if os.environ.get("MINITRAIN_DEVICE"):
    set_device(os.environ["MINITRAIN_DEVICE"])

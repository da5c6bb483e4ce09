"""The switch: which array module new arrays come from (NumPy on the CPU, CuPy on a CUDA GPU, as in
needle), which GPU this process computes on, and which module owns a given array.

MINITRAIN_DEVICE=cuda (or minitrain.set_device("cuda")) selects CuPy; use_gpu(i) picks the GPU
(minitrain.comm.init() gives rank r its local rank's). This module holds the one copy of that state
(_cupy, _device, _gpu): backend.py and the other modules here read it in this module, at each call.
"""
import os
import sys

import numpy as np

from .host import launch_info

_cupy = None          # the cupy module, once imported
_device = "cpu"
_gpu = 0              # the GPU this process computes on (each thread makes it current: bind_thread)


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


class DeviceUnavailable(RuntimeError):
    """MINITRAIN_DEVICE names a device this machine cannot give (unknown, or CuPy missing)."""


def _program():
    """The running program's name as argparse gives it ("mlp.py" for python -m minitrain.examples.mlp, whose
    sys.argv[0] is "-m" while the package imports)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1].rsplit(".", 1)[-1] + ".py"
    name = os.path.basename(sys.argv[0])
    return name if name and not name.startswith("-") else "python"


def _one_line(previous):
    """sys.excepthook for DeviceUnavailable, refused as a bad option is: one line from the launcher's rank 0, exit
    status 2 on every rank, not a traceback per rank (it is raised while minitrain imports, before any job can
    catch it); anything else goes to ``previous``."""
    def hook(kind, value, tb):
        if not issubclass(kind, DeviceUnavailable):
            return previous(kind, value, tb)
        if launch_info()[0] == 0:
            print(f"{_program()}: error: {value}", file=sys.stderr, flush=True)
        os._exit(2)
    return hook


if os.environ.get("MINITRAIN_DEVICE"):
    try:
        set_device(os.environ["MINITRAIN_DEVICE"])
    except (ValueError, RuntimeError) as e:
        sys.excepthook = _one_line(sys.excepthook)
        raise DeviceUnavailable(f"MINITRAIN_DEVICE={os.environ['MINITRAIN_DEVICE']}: {e}") from None

"""The micro-measurements calibrate makes, each the way the jobs run it (in sequence on distinct arrays, as a
step uses them: ops.in_sequence; the best of several, by the measuring thread's CPU time or the wall clock):
matmul FLOP rates (square n x n x n, a Linear's m rows x w-wide weight, per product of a batch), seconds per
element of plain elementwise passes, and the cost of first touching new memory.
"""
import time

import numpy as np

from .ops import in_sequence


def _xp():
    from .. import backend
    return backend.xp(), backend.synchronize


def _best(fn, repeats, sync, clock=time.perf_counter):
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        sync()
        best = min(best, clock() - t)
    return best


def _clock(threads=1):
    """The measuring thread's CPU time on a CPU where it alone works (see the module docstring), else the wall."""
    from .. import backend
    return time.thread_time if backend.get_device() == "cpu" and threads == 1 else time.perf_counter


def _dtype(name):
    from ..backend import bfloat16
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def measure_matmul(dtype, sizes, repeats=5, batch=1, clock=time.perf_counter):
    """[[n, FLOP/s]] for n x n @ n x n (``batch`` > 1: per product of a batch of them, one NumPy call), run
    in sequence on distinct operands, the products kept (ops.in_sequence: as a step runs them)."""
    xp, sync = _xp()
    out = []
    for n in sizes:
        shape = (n, n) if batch == 1 else (batch, n, n)
        copies = int(min(16, max(2, (16 << 20) // (3 * 4 * batch * n * n))))      # ~16 MiB of operands
        rng = np.random.default_rng(0)
        pairs = [[xp.asarray(rng.random(shape)).astype(_dtype(dtype)) for _ in range(2)] for _ in range(copies)]
        slow = dtype == "float16" and xp is np and n * batch ** (1 / 3) >= 64     # no BLAS for fp16 on NumPy
        runs = [(lambda a=a, b=b: a @ b) for a, b in (pairs[:2] if slow else pairs)]
        out.append([n, batch * 2 * n ** 3 / in_sequence(runs, sync, 1 if slow else repeats, clock)])
    return out


ROWS, WIDTHS = (8, 32, 128, 512), (16, 64, 256, 1024)


def measure_matmul_rows(dtype, repeats=5, clock=time.perf_counter):
    """{"rows": ROWS, "width": WIDTHS, "flops": [[FLOP/s]]}: m x w @ w x w products (a Linear layer's: m rows,
    a w x w weight, transposed), each on its own weight, in sequence (ops.in_sequence). A few rows on a wide
    weight run far below the square product of the same FLOPs (measured here: 32 rows x 256 at 35 GFLOP/s,
    128^3 at 80): the weight is read and packed for few rows. float16 (no BLAS on NumPy): the small corner only."""
    xp, sync = _xp()
    rng = np.random.default_rng(0)
    table = []
    for m in ROWS:
        row = []
        for w in WIDTHS:
            if dtype == "float16" and xp is np and m * w * w > 1 << 16:
                row.append(row[-1] if row else table[-1][0])
                continue
            copies = int(min(16, max(2, (16 << 20) // (4 * (2 * m * w + w * w)))))
            sets = [(xp.asarray(rng.random((m, w))).astype(_dtype(dtype)), xp.asarray(rng.random((w, w))).astype(_dtype(dtype)))
                    for _ in range(copies)]
            row.append(2 * m * w * w / in_sequence([(lambda a=a, b=b: a @ b.T) for a, b in sets], sync, repeats, clock))
        table.append(row)
    return {"rows": list(ROWS), "width": list(WIDTHS), "flops": table}


def measure_elementwise(dtype, n=1 << 18, repeats=5, clock=time.perf_counter, copies=8):
    """Seconds per element of the kinds of elementwise work a step does: ``simple`` (a + b, a new
    array), ``inplace`` (a += b), ``transcendental`` (tanh, exp), ``reduce`` (a sum along the last axis) and ``scatter``
    (an embedding's backward: rows added at repeated indices); each in sequence on distinct arrays (ops.in_sequence)."""
    xp, sync = _xp()
    from ..backend import scatter_add
    rng = np.random.default_rng(0)
    sets = [[xp.asarray(rng.random(n)).astype(_dtype(dtype)) for _ in range(2)] for _ in range(copies)]
    index = xp.asarray(rng.integers(0, 97, n // 64))
    kinds = {"simple": lambda a, b: (lambda: a + b), "inplace": lambda a, b: (lambda: a.__iadd__(b)),
             "transcendental": lambda a, b: (lambda: xp.tanh(a)),
             "reduce": lambda a, b: (lambda: a.reshape(-1, 64).sum(axis=-1, keepdims=True)),
             "scatter": lambda a, b: (lambda t=xp.zeros((97, 64), a.dtype): scatter_add(t, index, a.reshape(-1, 64)))}
    return {kind: in_sequence([make(a, b) for a, b in sets], sync, repeats if kind != "scatter" else 2, clock) / n
            for kind, make in kinds.items()}


def measure_fresh_memory(n=1 << 16, arrays=16, repeats=5):
    """Seconds per byte of first touching new memory: making arrays that stay alive (what forward does
    with the activations it saves) minus making as many that are freed at once (which reuse the same
    pages). On a virtual machine each new page costs a fault, often more than the arithmetic."""
    xp, sync = _xp()
    a = xp.ones(n, np.float32)

    def kept():
        return [a + 1.0 for _ in range(arrays)]

    def freed():
        for _ in range(arrays):
            a + 1.0
    return max(0.0, (_best(kept, repeats, sync) - _best(freed, repeats, sync)) / (arrays * a.nbytes))

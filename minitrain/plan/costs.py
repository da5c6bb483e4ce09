"""Seconds of a rank's Work (plan/work.py) on one machine: matmuls at the calibrated FLOP rate of their size
(one product on the rows x width grid, a batch of them on its own curve), each op at its calibrated cost per
call and per element (plan/ops.py), plain elementwise passes per element, the engine's Python per graph node
and per parameter given a gradient, the library's own bookkeeping (DDP's hooks, FSDP's units, traced spans,
a pipeline's actions, ring attention's chunk pairs) and the first touch of new memory.
"""
import math

from .layout import PRECISIONS
from .ops import op_fit

DTYPE_NAMES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class Costs:
    """Seconds of Work on one rank of ``machine`` with ``threads`` BLAS threads; ``slowdown`` > 1 when
    ranks outnumber cores (they take turns); ``fresh``: whether new memory costs page faults (no, below the
    size the jobs' held heap serves: backend.hold_host_memory)."""

    def __init__(self, machine, precision, threads=1, slowdown=1.0, fresh=True):
        self.m, self.slowdown, self.fresh = machine, slowdown, fresh
        self.dtype = DTYPE_NAMES[precision]
        self.e = PRECISIONS[precision]
        self.threads = threads
        self.curve = self._curve("matmul_flops", threads)
        self.batched = self._curve("matmul_batched_flops", threads) or self.curve
        self.grid = self._grid(threads)
        self.call, self.node_s = machine["numpy_call_s"], machine["autograd_node_s"]
        self.leaf_s = machine.get("leaf_grad_s", 0.0)
        self.fits = _fits(id(machine), machine)          # (op, dtype) -> (per call, per element), memoized

    def _curve(self, key, threads):
        """The calibrated (size, FLOP/s) curve at ``threads``; between two calibrated thread counts each size's
        rate is interpolated linearly in the threads (calibrate measures 1, the cores and cores / ranks: a thread
        count between them, priced at the most threads' rates, would run as if it had more cores than it has);
        beyond them the nearest."""
        table = self.m.get(key, {}).get(self.dtype, {})
        if not table:
            return None
        low, high, w = _bracket(table, threads)
        if w == 0.0:
            return sorted(table[low])
        hi = dict(table[high])
        return sorted((n, r + w * (hi[n] - r)) for n, r in table[low] if n in hi)

    def _grid(self, threads):
        """The rows x width grid at ``threads``, interpolated as _curve's rates are."""
        grids = self.m.get("matmul_rows_flops", {}).get(self.dtype, {})
        if not grids:
            return None
        low, high, w = _bracket(grids, threads)
        if w == 0.0 or grids[low]["rows"] != grids[high]["rows"] or grids[low]["width"] != grids[high]["width"]:
            return grids[low if w < 0.5 else high]
        flops = [[a + w * (b - a) for a, b in zip(ra, rb)] for ra, rb in zip(grids[low]["flops"], grids[high]["flops"])]
        return {**grids[low], "flops": flops}

    @staticmethod
    def rate(m, k, n, pts):
        """FLOP/s of an m x k @ k x n product on a calibrated curve ``pts`` of n x n x n products (square, or per
        product of a batch) at its size (m·k·n)^(1/3): the square of the same FLOPs. (A single product of a few
        rows by a wide weight runs well below it: ``single`` prices those on the rows x width grid.)"""
        q = (m * k * n) ** (1 / 3)
        if q <= pts[0][0]:
            return pts[0][1] * q / pts[0][0]                   # below the table: overhead-bound, linear
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if q <= n1:
                w = math.log(q / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
        return pts[-1][1]

    def single(self, m, k, n):
        """FLOP/s of one m x k @ k x n product: on the calibrated rows x width grid (log-log interpolation,
        width sqrt(k·n), clamped to the grid), else the square curve."""
        if self.grid is None:
            return self.rate(m, k, n, self.curve)
        rows, widths, table = self.grid["rows"], self.grid["width"], self.grid["flops"]

        def where(x, axis):
            x = min(max(x, axis[0]), axis[-1])
            i = max(0, min(len(axis) - 2, sum(1 for a in axis if a <= x) - 1))
            return i, math.log(x / axis[i]) / math.log(axis[i + 1] / axis[i])
        (i, u), (j, w) = where(m, rows), where(math.sqrt(k * n), widths)
        logs = [[math.log(table[i + a][j + b]) for b in (0, 1)] for a in (0, 1)]
        return math.exp((1 - u) * ((1 - w) * logs[0][0] + w * logs[0][1]) + u * ((1 - w) * logs[1][0] + w * logs[1][1]))

    def seconds(self, work):
        t = sum(2 * m * k * n / self.single(m, k, n) if batch == 1 else batch * 2 * m * k * n / self.rate(m, k, n, self.batched)
                for m, k, n, batch in work.mm)
        for (name, dtype), (n, calls) in work.ops.items():
            key = (name, DTYPE_NAMES.get(dtype, self.dtype) if dtype else self.dtype)
            fit = self.fits.get(key) or self.fits.setdefault(key, op_fit(self.m, *key))
            t += calls * fit[0] + n * fit[1]
        per = self.m["elementwise_s_per_element"]
        t += sum(n * per[DTYPE_NAMES.get(dtype, self.dtype) if dtype else self.dtype][kind]
                 for (kind, dtype), n in work.ew.items())
        t += (work.nodes + work.unrecorded) * self.node_s + work.leaves * self.leaf_s + work.calls * self.call
        t += len(work.mm) * self.call if self.grid is None else 0.0     # a datasheet's rates leave out the launch
        t += work.fresh * self.m.get("fresh_memory_s_per_byte", 0.0) if self.fresh else 0.0
        t += (work.hooks * self.m.get("ddp_param_s", 0.0) + work.units * self.m.get("fsdp_unit_s", 0.0)
              + work.spans * self.m.get("trace_span_s", 0.0)
              + work.actions * self.m.get("pipeline_action_s", 0.0) + work.ring_pairs * self.m.get("ring_pair_s", 0.0))
        return self.slowdown * t


_FITS = {}


def _fits(key, machine):
    """The ops' costs of one machine, looked up once (a --search prices thousands of layouts)."""
    if key not in _FITS or _FITS[key][0] is not machine:
        _FITS[key] = (machine, {})
    return _FITS[key][1]


def _bracket(table, threads):
    """(the calibrated thread count at or below ``threads``, the one at or above, the weight of the second):
    keys of ``table`` as strings; beyond the calibrated counts the nearest, weight 0."""
    counts = sorted(int(k) for k in table)
    below = [c for c in counts if c <= threads] or counts[:1]
    above = [c for c in counts if c >= threads] or counts[-1:]
    low, high = below[-1], above[0]
    w = 0.0 if high == low else (threads - low) / (high - low)
    return str(low), str(high), w

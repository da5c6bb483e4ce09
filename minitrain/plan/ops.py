"""What one op of a step costs, beyond its matmuls: seconds per call plus seconds per element.

plan calibrate measures each op on the library's own code (Function.forward / backward of
autograd/ops.py, the optimizers, the engine's gradient sums), at two sizes, and fits t = a + b·n: every
temporary array, broadcast operand and short row an op makes is in its figure, which counting passes over
memory missed by 2x (a LayerNorm's forward makes 7 passes, 4 of them against a broadcast operand at 2.5x
the cost of a plain one). A machine known only from its datasheet (machines/a100-80gb.json) has no
such table: each op is then its PASSES over memory at the datasheet's bandwidth, one kernel launch each.
An op is charged by the elements named beside it in PASSES (its output's, unless said otherwise).
"""
import math
import time

import numpy as np

WIDTH = 64                    # the row length the ops are measured at (a LayerNorm's h, a loss's classes)
SIZES = (4096, 131072)        # elements: the two problem sizes of the fit
# name: ({kind: passes}, what n counts); kinds as calibrate's elementwise table (simple, inplace, reduce, ...)
PASSES = {
    "bias": ({"inplace": 1}, "the Linear's output (out += b)"),
    "sum_leading": ({"reduce": 1}, "the gradient summed over leading axes (a bias's, a broadcast add's)"),
    "add": ({"simple": 1}, "a + b, a new array (a residual; two gradients meeting)"),
    "inplace_add": ({"inplace": 1}, "a += b (a gradient added into one the engine owns)"),
    "copy": ({"simple": 1}, "a strided view made contiguous (heads laid side by side again)"),
    "zeros": ({"inplace": 1}, "a new zero array (GetItem's backward)"),
    "cast": ({"simple": 1}, "astype to another float dtype"),
    "relu": ({"simple": 1}, "ReLU"), "relu.backward": ({"simple": 2}, "ReLU"),
    "gelu": ({"simple": 8, "transcendental": 1}, "GELU's input"), "gelu.backward": ({"simple": 12}, "GELU's input"),
    "softmax": ({"simple": 3, "reduce": 3, "transcendental": 1}, "attention scores (scaled, masked)"),
    "softmax.backward": ({"simple": 4, "reduce": 2}, "attention scores"),
    "layer_norm": ({"simple": 5, "reduce": 2}, "LayerNorm's input"),
    "layer_norm.backward": ({"simple": 7, "reduce": 4}, "LayerNorm's input"),
    "cross_entropy": ({"simple": 3, "reduce": 2, "transcendental": 2}, "logits"),
    "cross_entropy.backward": ({"simple": 2, "transcendental": 1}, "logits"),
    "embedding": ({"simple": 1}, "rows looked up"), "embedding.backward": ({"scatter": 1}, "rows looked up"),
    "dropout": ({"transcendental": 1, "simple": 2}, "dropout's input"), "dropout.backward": ({"simple": 1}, "its input"),
    "masked_fill": ({"simple": 1}, "the filled array"), "masked_fill.backward": ({"simple": 1}, "the filled array"),
    "adam": ({"inplace": 7, "simple": 6}, "parameters updated (per call: one tensor)"),
    "sgd": ({"inplace": 3, "simple": 2}, "parameters updated (per call: one tensor)"),
    "clip": ({"simple": 3, "reduce": 1}, "gradients in the norm (squares in float64; per call: one tensor)"),
}


def op_seconds(machine, name, elements, calls, dtype):
    """Seconds of ``calls`` calls of op ``name`` over ``elements`` elements in all, on ``machine``."""
    per_call, per_element = op_fit(machine, name, dtype)
    return calls * per_call + elements * per_element


def op_fit(machine, name, dtype):
    """(seconds per call, seconds per element) of op ``name`` in ``dtype``: measured, or from its passes."""
    fit = machine.get("ops", {}).get(dtype, {}).get(name)
    if fit is not None:
        return fit[0], fit[1]
    passes = PASSES[name][0]
    per = machine["elementwise_s_per_element"][dtype]
    return sum(passes.values()) * machine["numpy_call_s"], sum(k * per[kind] for kind, k in passes.items())


# ---------------------------------------------------------------- calibration
def _function(cls, args, kwargs=None, needs=None):
    """(forward, backward) callables of a Function on raw arrays, as the engine calls them (the graph
    node's own bookkeeping is the calibrated autograd_node_s, not part of the op)."""
    def ctx(record):
        c = cls.__new__(cls)
        c._record, c._saved, c._saved_keys, c._unpack = record, (), None, None
        c.needs_input_grad = needs or tuple(True for _ in args)
        return c
    node = ctx(True)
    out = cls.forward(node, *args, **(kwargs or {}))
    grad = np.ones_like(out) if not hasattr(out, "device") else out * 0 + 1
    return (lambda: cls.forward(ctx(False), *args, **(kwargs or {}))), (lambda: cls.backward(node, grad)), node


def _builders(xp, dtype):
    """name -> build(n): a callable running the op once on about n elements (as PASSES counts them)."""
    from .. import kernels, nn, optim
    from ..autograd import ops
    rng = np.random.default_rng(0)

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape)).astype(dtype)

    def rows(n):
        return arr(n // WIDTH, WIDTH)

    def fn(cls, make, kwargs=None, needs=None, backward=False):
        def build(n):
            forward, back, node = _function(cls, make(n), kwargs, needs)
            build.nodes.append(node)
            return back if backward else forward
        build.nodes = []
        return build

    def scores(n):
        return [arr(n // (4 * 32 * 32), 4, 32, 32)]

    mask = xp.triu(xp.ones((32, 32), dtype=bool), k=1)
    targets = (lambda n: [rows(n), xp.asarray(rng.integers(0, WIDTH, n // WIDTH))])
    lookup = (lambda n: [xp.asarray(rng.integers(0, 97, n // WIDTH)), arr(97, WIDTH)])
    ln = (lambda n: [rows(n), arr(WIDTH), arr(WIDTH)])
    other = np.float32 if np.dtype(dtype) != np.float32 else np.float64

    def optimizer(make):
        def build(n):
            p = nn.Parameter(arr(n))
            p.grad = arr(n)
            opt = make([p])
            return opt.step
        return build

    def clip(n):
        p = nn.Parameter(arr(n))
        p.grad = arr(n) * 1e-3
        return lambda: optim.clip_grad_norm_([p], 1e6)

    def copy(n):
        x = arr(n // (32 * WIDTH), 4, 32, WIDTH // 4).transpose(0, 2, 1, 3)
        return lambda: xp.ascontiguousarray(x)

    def pair(op):
        def build(n):
            a, b = rows(n), rows(n)
            return lambda: op(a, b)
        return build
    table = {
        "bias": lambda n: (lambda out=rows(n), b=arr(WIDTH): out.__iadd__(b)),
        "sum_leading": lambda n: (lambda g=rows(n): kernels.sum_leading(g, 1)),
        "add": pair(lambda a, b: a + b),
        "inplace_add": pair(lambda a, b: a.__iadd__(b)),
        "copy": copy,
        "zeros": lambda n: (lambda: xp.zeros(n, dtype)),
        "cast": lambda n: (lambda a=rows(n): a.astype(other)),
        "adam": optimizer(lambda ps: optim.AdamW(ps, lr=1e-3)),
        "sgd": optimizer(lambda ps: optim.SGD(ps, lr=1e-3, momentum=0.9)),
        "clip": clip,
    }
    functions = {"relu": (ops.ReLU, lambda n: [rows(n)], None, None),
                 "gelu": (ops.GELU, lambda n: [rows(n)], None, None),
                 "softmax": (ops.Softmax, scores, {"axis": -1, "scale": 0.25, "mask": mask}, None),
                 "layer_norm": (ops.LayerNorm, ln, None, None),
                 "cross_entropy": (ops.CrossEntropy, targets, None, (True, False)),
                 "embedding": (ops.Embedding, lookup, None, (False, True)),
                 "dropout": (ops.Dropout, lambda n: [rows(n), 0.1], None, (True, False)),
                 "masked_fill": (ops.MaskedFill, lambda n: [rows(n), xp.zeros((n // WIDTH, 1), bool), 0.0], None,
                                 (True, False, False))}
    for name, (cls, make, kwargs, needs) in functions.items():
        table.setdefault(name, fn(cls, make, kwargs, needs))
        table.setdefault(name + ".backward", fn(cls, make, kwargs, needs, backward=True))
    return table


def measure_ops(dtype, xp, sync, repeats=5, clock=time.thread_time):
    """{op: [seconds per call, seconds per element]} of every op in PASSES, in ``dtype`` (ops the dtype
    does not support are left out: the planner falls back to their passes)."""
    out = {}
    wide = np.dtype(dtype).itemsize >= 4        # float16 / bfloat16 run without SIMD on NumPy: fewer, shorter runs
    with np.errstate(all="ignore"):            # float16 Adam on random numbers overflows: the time is what counts
        for name, build in _builders(xp, dtype).items():
            fit = _measure(build, sync, repeats if wide else 2, clock, copies=16 if wide else 4)
            if fit is not None:
                out[name] = fit
    return out


def in_sequence(runs, sync, repeats, clock):
    """Seconds per call of ``runs`` (callables on distinct arrays) run one after another, their results kept
    until all have run: an op as a step runs it, on inputs other ops made and into outputs that stay alive
    for backward. (The same call repeated on the same arrays finds them in the caches and its outputs in
    freed, cached memory: measured here, 1.1-1.8x faster than the same op inside a GPT step; run this way,
    within 0.88-1.15x of it.) The best of ``repeats`` rounds."""
    runs[0]()
    sync()
    best = math.inf
    for _ in range(repeats):
        keep = []
        t = clock()
        for run in runs:
            keep.append(run())
        sync()
        best = min(best, (clock() - t) / len(runs))
        del keep
    return best


def _measure(build, sync, repeats, clock, copies=16):
    """(seconds per call, per element) of one op, fitted through its times at the two SIZES (in_sequence)."""
    points = []
    try:
        for n in SIZES:
            points.append(in_sequence([build(n) for _ in range(copies)], sync, repeats, clock))
    except (TypeError, ValueError, NotImplementedError):
        return None
    finally:
        for node in getattr(build, "nodes", []):
            node.release_saved()
        getattr(build, "nodes", []).clear()
    per_element = max(0.0, (points[1] - points[0]) / (SIZES[1] - SIZES[0]))
    return [max(0.0, points[0] - per_element * SIZES[0]), per_element]

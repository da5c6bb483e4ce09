"""Fused elementwise kernels for the GPU: each function here is one cupy.fuse kernel (or a
reduction fused with the elementwise work before and after it), where the NumPy code of the same
op launches one kernel per operation. The CPU keeps its own NumPy code (autograd/ops/, adam.py): the
numbers there stay exactly what they were.

Kernel launches per call, forward / backward (gradient accumulation included), before -> after, as
the CuPy stand-in counts them on a (4, 8, 16) float32 input:
  GELU 9 / 13 -> 1 / 1             softmax 5 / 4 -> 3 / 2          log-softmax 6 / 4 -> 3 / 2
  layer norm 10 / 11 -> 4 / 5      dropout 4 and a host-to-device copy of the mask / 1 -> 3 (2 are
  cuRAND's) / 1, keeping a bool mask instead of a float one      Adam 15 -> 1, AdamW 14 -> 1 per parameter
(scripts/bench_gpu.py counts a whole GPT step's launches under the CuPy stand-in.)
Python scalars are kernel arguments (changing the learning rate does not recompile); reductions
inside a fused kernel take no keepdims (CuPy's fusion has none), so their results are reshaped.
"""
import math

from .backend import array_module, elementwise_kernel, fuse, is_device_array

GELU_C = math.sqrt(2.0 / math.pi)


def _gelu(xp):
    def gelu(x):
        t = xp.tanh(GELU_C * (x + 0.044715 * x * x * x))
        return 0.5 * x * (1.0 + t), t
    return gelu


def _gelu_backward(xp):
    def gelu_backward(g, x, t):
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (GELU_C * (1.0 + 3 * 0.044715 * x * x)))
    return gelu_backward


gelu = fuse(_gelu, "minitrain_gelu")                         # (x) -> (y, tanh), saved for backward
gelu_backward = fuse(_gelu_backward, "minitrain_gelu_backward")


# ---------------------------------------------------------------- softmax and log-softmax
def _per_axis(make, name):
    """Reductions need their axis when the kernel is built: one fused function per axis."""
    cache = {}

    def get(axis):
        if axis not in cache:
            axes = axis if isinstance(axis, tuple) else (axis,)
            cache[axis] = fuse(lambda xp: make(xp, axis), f"{name}_axis_" + "_".join(map(str, axes)))
        return cache[axis]
    return get


_sum_exp = _per_axis(lambda xp, axis: lambda x, m: xp.sum(xp.exp(x - m), axis=axis), "minitrain_sum_exp")
_log_sum_exp = _per_axis(lambda xp, axis: lambda x, m: xp.log(xp.sum(xp.exp(x - m), axis=axis)),
                         "minitrain_log_sum_exp")
_sum_product = _per_axis(lambda xp, axis: lambda a, b: xp.sum(a * b, axis=axis), "minitrain_sum_product")
_normalize_exp = fuse(lambda xp: lambda x, m, s: xp.exp(x - m) / s, "minitrain_softmax_normalize")
# A row masked whole (its max -inf) gets weights 0, as in PyTorch's scaled_dot_product_attention, not the
# NaN of exp(-inf - -inf): the same two kernels with the row's -inf taken out.
_sum_exp_masked = _per_axis(lambda xp, axis: lambda x, m: xp.sum(xp.where(m == -math.inf, 0, xp.exp(x - m)),
                                                                   axis=axis), "minitrain_sum_exp_masked")
_normalize_exp_masked = fuse(lambda xp: lambda x, m, s: xp.where(s == 0, 0, xp.exp(x - m) / s),
                             "minitrain_softmax_normalize_masked")
_shift = fuse(lambda xp: lambda x, m, lse: x - m - lse, "minitrain_log_softmax_shift")
_softmax_grad = fuse(lambda xp: lambda out, g, s, scale: out * (g - s) * scale, "minitrain_softmax_backward")
_scale_and_mask = fuse(lambda xp: lambda x, mask, scale: xp.where(mask, -math.inf, x * scale), "minitrain_scale_and_mask")
_scale = fuse(lambda xp: lambda x, scale: x * scale, "minitrain_scale")


def scale_and_mask(x, scale, mask):
    """where(mask, -inf, x·scale): attention's scores before the softmax, in one pass."""
    return _scale(x, scale) if mask is None else _scale_and_mask(x, mask, scale)
_log_softmax_grad = fuse(lambda xp: lambda out, g, s: g - xp.exp(out) * s, "minitrain_log_softmax_backward")


def _keep(reduced, like, axis):
    """A fused reduction's result with the reduced axis put back (size 1): a view, no kernel."""
    axis = axis % like.ndim
    return reduced.reshape(like.shape[:axis] + (1,) + like.shape[axis + 1:])


def softmax(x, axis=-1, masked=False):
    """softmax along ``axis``; ``masked``: x went through scale_and_mask, and a row masked whole gives 0."""
    m = x.max(axis=axis, keepdims=True)
    if masked:
        s = _keep(_sum_exp_masked(axis % x.ndim)(x, m), x, axis)
        return _normalize_exp_masked(x, m, s)
    s = _keep(_sum_exp(axis % x.ndim)(x, m), x, axis)
    return _normalize_exp(x, m, s)


def softmax_backward(out, g, axis=-1, scale=1.0):
    """The gradient of softmax(x·scale) w.r.t. x (where the forward masked, out is 0: so is this)."""
    s = _keep(_sum_product(axis % out.ndim)(g, out), out, axis)
    return _softmax_grad(out, g, s, scale)


def log_softmax(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    lse = _keep(_log_sum_exp(axis % x.ndim)(x, m), x, axis)
    return _shift(x, m, lse)


def log_softmax_backward(out, g, axis=-1):
    s = g.sum(axis=axis, keepdims=True)
    return _log_softmax_grad(out, g, s)


# ---------------------------------------------------------------- layer norm
# The reductions are CuPy's own (x.mean(axis)): cupy.fuse's reductions over the last axis took 4-12 ms
# per call on an H100 at (64, 256, 384), 100x CuPy's reduction kernels (measured by scripts/bench_gpu.py
# with a per-kernel timer, 2026-11-23), so only the elementwise work around them is fused.
_center_square = fuse(lambda xp: lambda x, mean: (x - mean) * (x - mean), "minitrain_center_square")
_product = fuse(lambda xp: lambda a, b: a * b, "minitrain_product")
_rstd = fuse(lambda xp: lambda var, eps: 1.0 / xp.sqrt(var + eps), "minitrain_rstd")
_normalize = fuse(lambda xp: lambda x, mean, rstd, w, b: ((x - mean) * rstd * w + b, (x - mean) * rstd),
                  "minitrain_layer_norm")
_layer_norm_dx = fuse(lambda xp: lambda gw, xhat, rstd, a, b: rstd * (gw - a - xhat * b),
                      "minitrain_layer_norm_backward")


def sum_leading(a, k):
    """``a.sum(axis=(0, ..., k-1))``: a bias's or a LayerNorm weight's gradient. On the GPU, in float32 /
    float64, a matrix-vector product with ones (cuBLAS): CuPy's reduction over leading axes took ~370 us
    at (64, 256, 384) on an H100, the product ~20 us (scripts/bench_gpu.py's profile, 2026-11-23)."""
    if k == 0:
        return a
    if not is_device_array(a) or a.dtype.kind != "f" or a.dtype.itemsize < 4:
        return a.sum(axis=tuple(range(k)))
    rest = a.shape[k:]
    rows = a.reshape(-1, math.prod(rest)) if a.flags.c_contiguous else a.reshape(-1, math.prod(rest)).copy()
    return (_ones_like_rows(rows) @ rows).reshape(rest)


def _ones_like_rows(rows):
    """A cached vector of ones, one per row, on the rows' GPU."""
    key = (rows.shape[0], rows.dtype.str, rows.device.id)
    if key not in _ONES:
        with rows.device:
            _ONES[key] = array_module(rows).ones(rows.shape[0], rows.dtype)
    return _ONES[key]


_ONES = {}


def sum_product(axes):
    """sum_product(axes)(a, b) = sum(a * b, axis=axes) over leading axes: one fused product, one sum."""
    return lambda a, b: sum_leading(_product(a, b), len(axes))


def layer_norm(x, weight, bias, axes, eps):
    """(y, x̂, 1/σ) over ``axes`` (the last ones); weight / bias may be None."""
    mean = x.mean(axis=axes, keepdims=True)
    var = _center_square(x, mean).mean(axis=axes, keepdims=True)
    rstd = _rstd(var, eps)
    out, xhat = _normalize(x, mean, rstd, 1.0 if weight is None else weight, 0.0 if bias is None else bias)
    return out, xhat, rstd


def layer_norm_backward(g, xhat, rstd, weight, axes):
    """dx = (1/σ)(g·w - mean(g·w) - x̂·mean(g·w·x̂)), the means over ``axes``."""
    gw = g if weight is None else _product(g, weight)
    a = gw.mean(axis=axes, keepdims=True)
    b = _product(gw, xhat).mean(axis=axes, keepdims=True)
    return _layer_norm_dx(gw, xhat, rstd, a, b)


# ---------------------------------------------------------------- dropout
dropout = fuse(lambda xp: lambda x, u, p, scale: (x * (u >= p) * scale, u >= p), "minitrain_dropout")
dropout_backward = fuse(lambda xp: lambda g, keep, scale: g * keep * scale, "minitrain_dropout_backward")


# ---------------------------------------------------------------- cross-entropy pieces
_masked_nll = fuse(lambda xp: lambda picked, t, classes, inv_n: -xp.sum(
    xp.where((t < 0) | (t >= classes), math.nan, picked)) * inv_n, "minitrain_nll")
_softmax_of_logp = fuse(lambda xp: lambda logp, scale: xp.exp(logp) * scale, "minitrain_cross_entropy_backward")


def nll(picked, targets, classes):
    """Mean of -log p(target); NaN when a target lies outside [0, classes) (no host check)."""
    return _masked_nll(picked, targets, classes, 1.0 / max(picked.shape[0], 1))


def softmax_of_logp(logp, scale):
    return _softmax_of_logp(logp, scale)


count_nonfinite = fuse(lambda xp: lambda g: xp.sum(~xp.isfinite(g)), "minitrain_count_nonfinite")
square_sum = fuse(lambda xp: lambda g: xp.sum(g * g), "minitrain_square_sum")


# ---------------------------------------------------------------- optimizers
def _adam(xp):
    def adam(g, b1, b2, step_size, bias_correction2_sqrt, eps, decay, l2, p, m, v):   # the kernel's order
        g = g + l2 * p                       # Adam's L2 term (0 for AdamW)
        p *= decay                           # AdamW's decoupled decay (1 for Adam)
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * (g * g)
        p -= step_size * (m / (xp.sqrt(v) / bias_correction2_sqrt + eps))
    return adam


# In CUDA C on the GPU: cupy.fuse of _adam (in-place updates of its inputs) gave other numbers than the
# CPU's Adam on the H100 (tests/test_gpu.py, 2026-11-23); an ElementwiseKernel says what it updates.
adam_step = elementwise_kernel(
    _adam, "minitrain_adam",
    "G g, T b1, T b2, T step_size, T bias_correction2_sqrt, T eps, T decay, T l2", "T p, T m, T v",
    """T grad = (T)g + l2 * p;
       p = p * decay;
       m = b1 * m + (1 - b1) * grad;
       v = b2 * v + (1 - b2) * (grad * grad);
       p = p - step_size * (m / (sqrt(v) / bias_correction2_sqrt + eps));""")

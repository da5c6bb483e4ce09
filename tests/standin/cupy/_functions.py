"""The ``cupy.*`` functions of the stand-in: CuPy 14.2's namespace, each NumPy's function on device
arrays. NumPy arrays among the arguments are refused (TypeError, as CuPy's kernels refuse them);
host data enters only through ``asarray``/``array`` (counted host-to-device copies); a result that
is a view of an argument stays a view, anything else is one kernel on the current device.
"""
import numpy as np

from . import _standin as S
from ._core import UFUNCS, check_device, data_dependent_shape, new, ndarray, unsupported, unwrap, wrap_result

# cupy/__init__.py at v14.2.0: the names CuPy exports that are NumPy functions of the same meaning
NAMES = set("""abs absolute add all allclose amax amin angle any append apply_along_axis arange arccos arccosh
arcsin arcsinh arctan arctan2 arctanh argmax argmin argpartition argsort argwhere around array array_equal
array_equiv array_split asanyarray asarray ascontiguousarray asfortranarray atleast_1d atleast_2d atleast_3d
average bincount bitwise_and bitwise_not bitwise_or bitwise_xor broadcast_arrays broadcast_shapes broadcast_to
cbrt ceil choose clip column_stack compress concatenate conj conjugate convolve copy copysign copyto corrcoef
cos cosh count_nonzero cov cross cumprod cumsum deg2rad degrees delete diag diagflat diagonal diff digitize
divide divmod dot dsplit dstack einsum empty empty_like equal exp exp2 expand_dims expm1 extract eye fabs
fill_diagonal fix flatnonzero flip fliplr flipud float_power floor floor_divide fmax fmin fmod frexp full
full_like gcd greater greater_equal heaviside histogram hsplit hstack hypot identity imag inner invert isclose
iscomplex isfinite isin isinf isnan isreal kron lcm ldexp left_shift less less_equal linspace log log10 log1p
log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logspace matmul max maximum mean
median meshgrid min minimum mod modf moveaxis multiply nan_to_num nanargmax nanargmin nancumprod nancumsum
nanmax nanmean nanmedian nanmin nanprod nanstd nansum nanvar ndim negative nextafter nonzero not_equal ones
ones_like outer pad partition percentile place positive power prod ptp put putmask quantile rad2deg radians
ravel real reciprocal remainder repeat reshape resize right_shift rint roll rollaxis rot90 round searchsorted
select shape sign signbit sin sinc sinh size sort split sqrt square squeeze stack std subtract sum swapaxes take
take_along_axis tan tanh tensordot tile trace transpose tri tril triu true_divide trunc unique var vdot vsplit
vstack where zeros zeros_like""".split())

_CREATION = {"arange", "empty", "eye", "full", "identity", "linspace", "logspace", "ones", "tri", "zeros"}
_LIKE = {"empty_like", "full_like", "ones_like", "zeros_like"}
_NO_ARRAY_RESULT = {"shape", "size", "ndim", "broadcast_shapes"}
_FUSION_REDUCTIONS = {"sum": "sum", "prod": "prod", "amax": "max", "amin": "min", "max": "max", "min": "min"}
# results whose size depends on the data: CuPy reads a count back first (a synchronisation)
DATA_DEPENDENT = {"argwhere", "compress", "extract", "flatnonzero", "nonzero", "unique"}
# CuPy's sorts (thrust) have no bfloat16: NotImplementedError (seen on an H200 with CuPy 14.2)
SORTS = {"sort", "argsort", "lexsort", "msort", "partition", "argpartition", "unique"}


def refuse_unsortable(arrays):
    for a in arrays:
        if a.dtype.char == "E":
            raise NotImplementedError(f"Sorting arrays with dtype '{a.dtype}' is not supported")


def _generic(name):
    np_func = getattr(np, name)

    def func(*args, **kwargs):
        if S.fusing() and name not in _FUSION_REDUCTIONS and name != "where":
            raise TypeError(f"cupy.{name} is not supported in cupy.fuse (the stand-in allows what CuPy's fusion "
                            "compiles: ufuncs, cupy.where, astype, copy, x[...] = y, one sum/prod/amax/amin)")
        found = []
        if name == "concatenate" and args and any(not isinstance(a, ndarray) for a in args[0]):
            bad = next(a for a in args[0] if not isinstance(a, ndarray))
            raise TypeError(f"Unsupported type {type(bad)}")   # CuPy 14.2 on an H100 (2026-11-23): _preprocess_arg
        raw = [unwrap(a, found) for a in args]
        raw_kwargs = {k: unwrap(v, found) for k, v in kwargs.items()}
        if name in SORTS:
            refuse_unsortable(found)
        out = kwargs.get("out")
        state = S.fusion_state()
        if state is not None:
            return _fused_call(name, np_func, raw, raw_kwargs, found, kwargs, state)
        if name in _NO_ARRAY_RESULT:
            return np_func(*raw, **raw_kwargs)
        if out is not None:
            check_device(found)
            with np.errstate(all="ignore"):
                np_func(*raw, **raw_kwargs)
            S.kernel(name)
            return out
        if name in DATA_DEPENDENT or (name == "where" and len(args) == 1):
            data_dependent_shape(name)
        with np.errstate(all="ignore"):
            r = np_func(*raw, **raw_kwargs)
        return wrap_result(r, found, name)
    func.__name__ = name
    return func


def _fused_call(name, np_func, raw, raw_kwargs, found, kwargs, state):
    if name == "where":
        state.ufunc(found, ())
        r = new(np.asarray(np_func(*raw)))
        state.produced(found, (r,))
        return r
    if kwargs.get("keepdims"):
        raise NotImplementedError(f"cupy.{name} does not support `keepdims` in fusion yet.")
    state.reduction(found)
    with np.errstate(all="ignore"):
        r = new(np.asarray(np_func(*raw, **raw_kwargs)))
    state.produced_by_reduction(r)
    return r


def _creation(name):
    np_func = getattr(np, name)

    def func(*args, **kwargs):
        if S.fusing():
            raise TypeError(f"cupy.{name} is not supported in cupy.fuse")
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, (ndarray, np.ndarray)):
                raise unsupported(a)
        r = new(np.asarray(np_func(*args, **kwargs)))
        if name not in ("empty",):
            S.kernel(name)
        return r
    func.__name__ = name
    return func


def _like(name):
    np_func = getattr(np, name)

    def func(a, *args, **kwargs):
        if S.fusing():
            raise TypeError(f"cupy.{name} is not supported in cupy.fuse")
        shape_of = a._a if isinstance(a, ndarray) else np.asarray(a)
        r = new(np_func(shape_of, *args, **kwargs))
        if name != "empty_like":
            S.kernel(name)
        return r
    func.__name__ = name
    return func


def asarray(a, dtype=None, order=None, *, blocking=False):
    """A device array: ``a`` itself when it is one (of that dtype), else a copy of host data (counted)."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.array(a, dtype=dtype, order=order or "K", copy=True)
    S.add("h2d")
    S.add("h2d_bytes", host.nbytes)
    return new(host)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        r = obj.astype(obj.dtype if dtype is None else dtype, copy=bool(copy) or copy is None)
        return r if ndmin <= r.ndim else r.reshape((1,) * (ndmin - r.ndim) + r.shape)
    host = np.array(obj, dtype=dtype, order=order, ndmin=ndmin, copy=True)
    S.add("h2d")
    S.add("h2d_bytes", host.nbytes)
    return new(host)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """A NumPy copy of a device array (a counted, blocking device-to-host copy); host data as is."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if out is not None:
        out[...] = a
        return out
    return np.asarray(a, order=order)


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError("copyto: dst must be a cupy.ndarray")
    if isinstance(src, np.ndarray) and src.ndim > 0:
        raise unsupported(src)
    found = [dst] + ([src] if isinstance(src, ndarray) else [])
    check_device(found)
    np.copyto(dst._a, src._a if isinstance(src, ndarray) else src, casting=casting,
              where=True if where is None else unwrap(where, found))
    S.kernel("copyto")


def _matmul_costs(generic):
    """cupy.matmul beyond two dimensions (cupy/_core/_routines_linalg.pyx): each operand is made
    contiguous first (a copy kernel when it is not), and broadcasting a batch dimension builds
    arrays of matrix pointers for a batched GEMM; a 2-D product is one GEMM on the arrays as they are.
    A batch in bfloat16 takes CuPy's integer kernels, which have no name for it: TypeError (seen on
    an H200 with CuPy 14.2)."""
    def matmul(a, b, out=None, **kwargs):
        if isinstance(a, ndarray) and isinstance(b, ndarray) and max(a.ndim, b.ndim) > 2 and not S.fusing():
            if np.promote_types(a.dtype, b.dtype).char == "E":
                raise TypeError("data type 'E' not understood")
            for x in (a, b):
                if not x._a.flags.c_contiguous:
                    S.kernel("matmul_contiguous_copy")
            if a.shape[:-2] != b.shape[:-2]:
                S.kernel("matmul_pointer_arrays")
        return generic(a, b, out=out, **kwargs) if out is not None else generic(a, b, **kwargs)
    matmul.__name__ = "matmul"
    return matmul


def get_array_module(*args):
    import cupy
    return cupy if any(isinstance(a, ndarray) for a in args) else np


def build_namespace():
    names = {}
    for name in NAMES:
        if name in UFUNCS:
            names[name] = UFUNCS[name]
        elif name in _CREATION:
            names[name] = _creation(name)
        elif name in _LIKE:
            names[name] = _like(name)
        elif hasattr(np, name):
            names[name] = _generic(name)
    names["matmul"] = _matmul_costs(names["matmul"])
    names.update(asarray=asarray, asanyarray=asarray, array=array, asnumpy=asnumpy, copyto=copyto,
                 get_array_module=get_array_module)
    return names

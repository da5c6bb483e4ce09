"""``cupy.ndarray`` of the stand-in: a NumPy array that lives on a device (ufuncs: _ufunc.py).

An array holds a NumPy array (its "device memory"), the id of the device it was made on, and the
array that owns its memory when it is a view (``.base``, as CuPy). What CuPy 14 refuses, this
refuses with CuPy's exception and message (cupy/_core/core.pyx, _kernel.pyx, _scalar.pyx,
_routines_indexing.pyx at v14.2.0); what CuPy copies or synchronises silently is counted.
"""
import numpy as np

from . import _standin as S
from ._ipc import shared_array, shared_empty
from ._ufunc import _MISSING, SCALAR_TYPES, UFUNCS, _binary, _inplace


def _peer_error(array_device):
    return ValueError(f"The device where the array resides ({array_device}) is different from the current "
                      f"device ({S.current_device()}). Peer access is unavailable between these devices.")


def check_device(arrays):
    """A kernel runs on the current device: every array it touches must live there."""
    device = S.current_device()
    for a in arrays:
        if a._dev != device:
            raise _peer_error(a._dev)


def unsupported(x):
    return TypeError(f"Unsupported type {type(x)}")


def np_owner(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def new(a, device=None, owner=None):
    """Wrap the NumPy array ``a`` (fresh memory unless ``owner``, the array whose memory it views)."""
    obj = ndarray.__new__(ndarray)
    obj._a = a if owner is not None else shared_array(a)
    obj._dev = S.current_device() if device is None else device
    obj._owner = owner
    if owner is None:
        S.allocated(obj._dev)
    return obj


def _base_of(a):
    """The array that owns ``a``'s memory (a view's base is its owner, as in CuPy)."""
    return a._owner if a._owner is not None else a


def wrap_result(r, inputs, name, check_inputs=True):
    """Wrap what NumPy returned: a view of an input stays a view (its base, its device, no kernel);
    anything else is a new array on the current device, made by one kernel."""
    if isinstance(r, (list, tuple)):
        items = [wrap_result(x, inputs, name, check_inputs=False) for x in r]
        if check_inputs and any(i._owner is None for i in items if isinstance(i, ndarray)):
            check_device(inputs)
        return type(r)(items) if isinstance(r, tuple) else items
    if r is None:
        return None
    if not isinstance(r, np.ndarray):
        r = np.asarray(r)                      # CuPy returns 0-d arrays, never scalars
    else:
        owner_np = np_owner(r)
        for w in inputs:
            if np_owner(w._a) is owner_np:
                return new(r, w._dev, _base_of(w))
    if check_inputs:
        check_device(inputs)
    S.kernel(name)
    return new(r)


def unwrap(x, found):
    """NumPy-side value of a function argument; device arrays are collected into ``found``.
    A NumPy array among them is refused as CuPy refuses it."""
    if isinstance(x, ndarray):
        found.append(x)
        return x._a
    if isinstance(x, np.ndarray):
        raise unsupported(x)
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(v, found) for v in x)
    return x


def _implicit_index(s):
    """Index arrays given as lists or NumPy arrays: CuPy copies them to the device silently."""
    if isinstance(s, ndarray) or s is None or s is Ellipsis or isinstance(s, slice):
        return s
    if isinstance(s, tuple):
        return tuple(_implicit_index(x) for x in s)
    if isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)):
        return s
    arr = np.asarray(s)
    S.implicit(f"an index of type {type(s).__name__}", arr.nbytes)
    return new(arr)


def data_dependent_shape(what):
    """CuPy must read a count back to size the result (a boolean mask, nonzero, unique...):
    a device-to-host copy, so a synchronisation (cupy/_core/_routines_indexing.pyx:
    ``n_true = int(mask_scanned[-1])``)."""
    S.add("d2h")
    S.add("d2h_bytes", 8)
    S.add("sync")


def _index(self, idx):
    """(NumPy index, whether it is advanced, the device arrays in it). A boolean mask costs a
    synchronisation, as in CuPy."""
    items = idx if isinstance(idx, tuple) else (idx,)
    raw, arrays, advanced = [], [], False
    for s in items:
        s = _implicit_index(s)
        if isinstance(s, ndarray):
            arrays.append(s)
            raw.append(s._a)
            advanced = True
            if s.dtype == np.bool_:
                data_dependent_shape("a boolean mask")
        else:
            raw.append(s)
    return tuple(raw), advanced, arrays


# ---------------------------------------------------------------- the array
class _Flags:
    def __init__(self, a, owndata):
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = owndata

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}[name]


def _to_host(self, what):
    """A blocking device-to-host copy (counted, and a synchronisation)."""
    S.add("d2h")
    S.add("d2h_bytes", self._a.nbytes)
    S.add("sync")
    return self._a.copy()


class ndarray:
    __slots__ = ("_a", "_dev", "_owner", "__weakref__")
    __array_priority__ = 100
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is None:
            a = shared_empty(shape, dtype, order=order)
            self._a, self._dev, self._owner = a, S.current_device(), None
            S.allocated(self._dev)
        else:                                   # a view of existing device memory (CuPy: base is None)
            mem = memptr.mem
            self._a = np.ndarray(shape, dtype, buffer=mem.buffer, offset=memptr.ptr - mem.ptr,
                                 strides=strides, order=order)
            self._dev, self._owner = mem.device_id, None

    # ---- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    base = property(lambda self: self._owner)
    flags = property(lambda self: _Flags(self._a, self._owner is None))

    @property
    def device(self):
        from .cuda import Device
        return Device(self._dev)

    @property
    def data(self):
        """The MemoryPointer of the first element (a device pointer)."""
        from .cuda import Memory, MemoryPointer
        owner = np_owner(self._a)
        return MemoryPointer(Memory(owner, self._dev), self._a.__array_interface__["data"][0]
                             - owner.__array_interface__["data"][0])

    @property
    def T(self):
        return new(self._a.T, self._dev, _base_of(self))

    @property
    def mT(self):
        return new(np.swapaxes(self._a, -1, -2), self._dev, _base_of(self))

    @property
    def __cuda_array_interface__(self):
        if S.FORBID_DEVICE_POINTERS:
            raise TypeError("a device pointer was requested (__cuda_array_interface__) while the CuPy stand-in "
                            "forbids it (CUPY_STANDIN_FORBID_DEVICE_POINTERS=1): a non-CUDA-aware MPI given "
                            "one crashes; stage the array through host memory")
        S.add("device_pointers")
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": [("", self.dtype.str)],
                "data": (self._a.__array_interface__["data"][0], False),
                "strides": None if self._a.flags.c_contiguous else self._a.strides, "version": 3, "stream": 1}

    # ---- what CuPy refuses: implicit conversion to NumPy
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __buffer__(self, flags):                 # the buffer protocol (Python 3.12+)
        raise TypeError("Accessing a CuPy ndarry on CPU is not allowed except when using system memory "
                        "(on HMM or ATS enabled systems, need to set CUPY_ENABLE_UMP=1) or managed memory")

    def __getattr__(self, name):                 # __array_interface__ & co: CuPy has none of them
        raise AttributeError(f"'cupy.ndarray' object has no attribute '{name}'")

    # ---- numpy interoperability, as CuPy: dispatch to cupy, refuse NumPy arrays
    def __array_ufunc__(self, u, method, *inputs, **kwargs):
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            kwargs["out"] = out[0]
        target = UFUNCS.get(u.__name__)
        if target is None:
            return NotImplemented
        for x in inputs + ((kwargs["out"],) if "out" in kwargs else ()):
            if not isinstance(x, (ndarray, np.ndarray)) and not isinstance(x, SCALAR_TYPES):
                return NotImplemented
        if method == "__call__":
            return target(*inputs, **kwargs)
        if method in ("reduce", "accumulate", "outer", "at"):
            return getattr(target, method)(*inputs, **kwargs)
        return NotImplemented

    def __array_function__(self, func, types, args, kwargs):
        import cupy
        if func.__module__ != "numpy" or func.__name__ not in cupy._functions.NAMES:
            return NotImplemented
        if not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        return getattr(cupy, func.__name__)(*args, **kwargs)

    # ---- conversions: each a blocking copy to the host
    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if out.shape != self.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
            S.add("d2h")
            S.add("d2h_bytes", self.nbytes)
            if blocking:
                S.add("sync")
            out[...] = self._a
            return out
        S.add("d2h")
        S.add("d2h_bytes", self.nbytes)
        if blocking:
            S.add("sync")
        return np.array(self._a, order=order if order != "A" else "K")

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        S.add("h2d")
        S.add("h2d_bytes", arr.nbytes)
        self._a[...] = arr

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return _to_host(self, "item").item()

    def tolist(self):
        return _to_host(self, "tolist").tolist()

    def __float__(self):
        return float(_to_host(self, "float"))

    def __int__(self):
        return int(_to_host(self, "int"))

    def __complex__(self):
        return complex(_to_host(self, "complex"))

    def __bool__(self):
        if S.fusing():
            raise Exception("Can't cast to bool")
        if self.size == 0:
            return False
        if self.size > 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. "
                             "Use a.any() or a.all()")
        return bool(_to_host(self, "bool"))

    def __repr__(self):
        return repr(_to_host(self, "repr"))

    def __str__(self):
        return str(_to_host(self, "str"))

    def __format__(self, spec):
        return format(_to_host(self, "format"), spec)

    def __reduce__(self):
        import cupy
        return cupy.array, (self.get(),)

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        from .cuda import Device
        with Device(self._dev):
            return self.copy()

    # ---- indexing
    def __getitem__(self, idx):
        if S.fusing():
            raise TypeError("indexing is not supported in cupy.fuse")
        raw, advanced, arrays = _index(self, idx)
        r = self._a[raw]
        if not advanced:
            if not isinstance(r, np.ndarray):    # a full integer index: CuPy gives a 0-d view
                r = self._a[raw + (Ellipsis,)] if Ellipsis not in raw else np.asarray(r)
            return new(r, self._dev, _base_of(self))
        check_device([self] + arrays)
        S.kernel("take")
        return new(np.asarray(r))

    def __setitem__(self, idx, value):
        state = S.fusion_state()
        if state is not None:
            if idx is not Ellipsis and idx != slice(None):
                raise ValueError("The fusion supports `[...]` or `[:]`.")
            return _fused_copy(self, value)
        raw, advanced, arrays = _index(self, idx)
        if isinstance(value, ndarray):
            arrays.append(value)
            value = value._a
        elif not isinstance(value, SCALAR_TYPES):
            value = np.asarray(value)
            if not advanced:
                if value.shape != ():          # CuPy: "Refuse assignment from CPU arrays" (gh-2079)
                    raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            else:
                S.implicit(f"a value of type {type(value).__name__} in an advanced assignment", value.nbytes)
        check_device([self] + arrays)
        with np.errstate(all="ignore"):
            self._a[raw] = value
        S.kernel("scatter_update" if advanced else "copy")

    # ---- arithmetic: cupy ufuncs (NumPy arrays refused, other objects' reflected operators honoured)
    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("subtract"), _binary("subtract", True)
    __mul__, __rmul__ = _binary("multiply"), _binary("multiply", True)
    __truediv__, __rtruediv__ = _binary("true_divide"), _binary("true_divide", True)
    __floordiv__, __rfloordiv__ = _binary("floor_divide"), _binary("floor_divide", True)
    __mod__, __rmod__ = _binary("remainder"), _binary("remainder", True)
    __pow__, __rpow__ = _binary("power"), _binary("power", True)
    __and__, __rand__ = _binary("bitwise_and"), _binary("bitwise_and", True)
    __or__, __ror__ = _binary("bitwise_or"), _binary("bitwise_or", True)
    __xor__, __rxor__ = _binary("bitwise_xor"), _binary("bitwise_xor", True)
    __lshift__, __rshift__ = _binary("left_shift"), _binary("right_shift")
    __lt__, __le__ = _binary("less"), _binary("less_equal")
    __gt__, __ge__ = _binary("greater"), _binary("greater_equal")
    __iadd__, __isub__, __imul__ = _inplace("add"), _inplace("subtract"), _inplace("multiply")
    __itruediv__, __ipow__ = _inplace("true_divide"), _inplace("power")
    __iand__, __ior__, __ixor__ = _inplace("bitwise_and"), _inplace("bitwise_or"), _inplace("bitwise_xor")

    def __eq__(self, other):
        if other is None or (type(other).__eq__ is object.__eq__ and not isinstance(other, (ndarray, np.ndarray))):
            return new(np.zeros(self.shape, bool))
        return _binary("equal")(self, other)

    def __ne__(self, other):
        if other is None:
            return new(np.ones(self.shape, bool))
        return _binary("not_equal")(self, other)

    def __neg__(self):
        return UFUNCS["negative"](self)

    def __pos__(self):
        return UFUNCS["positive"](self)

    def __abs__(self):
        return UFUNCS["absolute"](self)

    def __invert__(self):
        return UFUNCS["invert"](self)

    def __matmul__(self, other):
        import cupy
        if not isinstance(other, (ndarray, np.ndarray)) and getattr(other, "__array_ufunc__", _MISSING) is None:
            return NotImplemented
        return cupy.matmul(self, other)

    def __rmatmul__(self, other):
        import cupy
        return cupy.matmul(other, self)


def _fused_copy(dst, value):
    """``x[...] = value`` inside a fused function (CuPy fusion supports only [...] and [:])."""
    arrays = [value] if isinstance(value, ndarray) else []
    S.fusion_state().ufunc(arrays, (dst,))
    dst._a[...] = value._a if isinstance(value, ndarray) else value

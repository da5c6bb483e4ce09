"""Tensor: an xp array, an optional gradient, and the graph node that produced it.

A tensor made by the user is a *leaf*; a tensor made by an operation on tensors that require
grad points at that operation's node (_ctx), and backward() walks those nodes back to
the leaves. Operators follow NumPy broadcasting; method names follow PyTorch where the two
differ (transpose(dim0, dim1) swaps two axes, permute(*dims) reorders all of them). The functions
that make tensors (tensor, zeros, ones, randn) and join or split them (cat, split) are creation.py's;
register_hook and register_post_accumulate_grad_hook, which Tensor inherits, are hooks.py's.
"""
import numpy as np

from .. import backend, memory
from .hooks import TensorHooks, check_grad


def _as_array(data, dtype=None):
    """The array a new tensor holds. On the GPU, host data is copied to the device on purpose
    (counted by backend), except inside ``memory.on_host()``, where offload keeps its tensors."""
    xp = backend.xp()
    if isinstance(data, Tensor):
        data = data._data
    if isinstance(data, (np.ndarray, np.generic)) or backend.is_device_array(data):
        arr = data if dtype is None else data.astype(dtype, copy=False)
        if backend.get_device() == "cuda" and not backend.is_device_array(arr) and \
                not memory.tracker().placing_on_host:
            arr = backend.to_device(arr)
        return arr
    arr = np.asarray(data)  # Python numbers and lists: floats take the default dtype
    if dtype is None and arr.dtype.kind == "f":
        dtype = backend.get_default_dtype()
    if dtype is not None:
        arr = arr.astype(dtype, copy=False)
    return arr if xp is np or memory.tracker().placing_on_host else backend.to_device(arr)


def _is_float(dtype):
    return dtype.kind == "f" or dtype in backend.LOW_PRECISION


class Tensor(TensorHooks):
    __slots__ = ("_data", "_grad", "_requires_grad", "_ctx", "_hooks", "_post_acc_hooks", "__weakref__")
    __array_ufunc__ = None        # ndarray + Tensor defers to Tensor.__radd__ and returns a Tensor
    __hash__ = object.__hash__    # tensors are dict keys by identity

    def __init__(self, data, requires_grad=False, dtype=None):
        self._data = _as_array(data, dtype)
        self._grad = None
        self._requires_grad = bool(requires_grad)
        if self._requires_grad and self._data.dtype.kind not in "fc" and self._data.dtype not in backend.LOW_PRECISION:
            raise TypeError(f"only floating tensors can require grad, got {self._data.dtype}")
        self._ctx = None
        self._hooks = None
        self._post_acc_hooks = None

    @classmethod
    def _wrap(cls, array):
        """A leaf around an existing array, without copying."""
        t = Tensor.__new__(Tensor)
        t._data, t._grad, t._requires_grad, t._ctx = array, None, False, None
        t._hooks = t._post_acc_hooks = None
        return t

    # ---- data and grad: plain attributes to read; properties so that Parameter can account memory
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value._data if isinstance(value, Tensor) else value

    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, value):
        self._grad = check_grad(self, value._data if isinstance(value, Tensor) else value)

    @property
    def grad_fn(self):
        return self._ctx

    @property
    def is_leaf(self):
        return self._ctx is None

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad=True):
        """Set ``requires_grad`` in place and return self, as PyTorch (freezing: ``p.requires_grad_(False)``)."""
        if self._ctx is not None and not requires_grad:
            raise RuntimeError("requires_grad = False on a computed tensor: only a leaf's flag can change (detach() "
                               "gives a tensor outside the graph)")
        if requires_grad and not _is_float(self._data.dtype):
            raise TypeError(f"only floating tensors can require grad, got {self._data.dtype}")
        self._requires_grad = bool(requires_grad)
        return self

    @property
    def shape(self):
        return self._data.shape

    @property
    def ndim(self):
        return self._data.ndim

    @property
    def dtype(self):
        return self._data.dtype

    @property
    def size(self):
        return self._data.size

    def numel(self):
        return self._data.size

    def __len__(self):
        return len(self._data)

    def item(self):
        """The value of a one-element tensor (on the GPU: a counted copy, the host waits for the GPU)."""
        return backend.to_scalar(self._data)

    def numpy(self):
        """The data as a NumPy array (copied from the GPU if need be)."""
        return backend.to_host(self._data)

    def detach(self):
        return Tensor._wrap(self._data)

    def astype(self, dtype):
        """A copy in another dtype, outside the graph."""
        return Tensor._wrap(self._data.astype(dtype))

    def to(self, dtype):
        """This tensor in ``dtype``, differentiable (as ``torch.Tensor.to(dtype)``); itself if
        already of that dtype."""
        if self._data.dtype == dtype:
            return self
        return ops.Cast.apply(self, dtype)

    def float(self):
        return self.to(np.float32)

    def __repr__(self):
        extra = ", requires_grad=True" if self.requires_grad else ""
        if self._ctx is not None:
            extra = f", grad_fn={self._ctx.name()}"
        return f"Tensor({self._data!r}{extra})"

    # ---- autograd
    def backward(self, grad=None, retain_graph=False):
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``. A non-scalar tensor takes the
        gradient that arrives from elsewhere (e.g. from the next pipeline stage) as ``grad``."""
        engine.backward(self, grad, retain_graph)

    # ---- operators
    def _operand(self, other):
        """Tensors pass through; arrays are cast to this tensor's floating dtype and NumPy scalars (np.sqrt(64)
        is a np.float64) become Python numbers, as PyTorch reads both: no silent widening."""
        if isinstance(other, Tensor):
            return other
        if isinstance(other, np.generic):
            return other.item()
        if isinstance(other, (int, float)):
            return other
        other = _as_array(other)
        if other.dtype != self._data.dtype and _is_float(other.dtype) and _is_float(self._data.dtype):
            other = other.astype(self._data.dtype)
        return other

    def __add__(self, other):
        return ops.Add.apply(self, self._operand(other))

    def __radd__(self, other):
        return ops.Add.apply(self._operand(other), self)

    def __sub__(self, other):
        return ops.Sub.apply(self, self._operand(other))

    def __rsub__(self, other):
        return ops.Sub.apply(self._operand(other), self)

    def __mul__(self, other):
        return ops.Mul.apply(self, self._operand(other))

    def __rmul__(self, other):
        return ops.Mul.apply(self._operand(other), self)

    def __truediv__(self, other):
        return ops.Div.apply(self, self._operand(other))

    def __rtruediv__(self, other):
        return ops.Div.apply(self._operand(other), self)

    def __pow__(self, other):
        return ops.Pow.apply(self, self._operand(other))

    def __rpow__(self, other):
        return ops.Pow.apply(self._operand(other), self)

    def __neg__(self):
        return ops.Neg.apply(self)

    def __matmul__(self, other):
        return ops.MatMul.apply(self, self._operand(other))

    def __rmatmul__(self, other):
        return ops.MatMul.apply(self._operand(other), self)

    def __getitem__(self, idx):
        if isinstance(idx, Tensor):
            idx = idx._data
        elif isinstance(idx, tuple):
            idx = tuple(i._data if isinstance(i, Tensor) else i for i in idx)
        return ops.GetItem.apply(self, idx)

    # comparisons give boolean tensors outside the graph; == stays identity (tensors are dict keys)
    def _compare(self, other, fn):
        other = other._data if isinstance(other, Tensor) else other
        return Tensor._wrap(fn(self._data, other))

    def __lt__(self, other):
        return self._compare(other, lambda a, b: a < b)

    def __le__(self, other):
        return self._compare(other, lambda a, b: a <= b)

    def __gt__(self, other):
        return self._compare(other, lambda a, b: a > b)

    def __ge__(self, other):
        return self._compare(other, lambda a, b: a >= b)

    def eq(self, other):
        return self._compare(other, lambda a, b: a == b)

    # ---- reductions and elementwise functions
    def sum(self, axis=None, keepdims=False):
        return ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis=None, keepdims=False):
        return ops.Mean.apply(self, axis=axis, keepdims=keepdims)

    def max(self, axis=None, keepdims=False):
        return ops.Max.apply(self, axis=axis, keepdims=keepdims)

    def exp(self):
        return ops.Exp.apply(self)

    def log(self):
        return ops.Log.apply(self)

    def tanh(self):
        return ops.Tanh.apply(self)

    def sqrt(self):
        return ops.Pow.apply(self, 0.5)

    def relu(self):
        return ops.ReLU.apply(self)

    def softmax(self, axis=-1):
        return ops.Softmax.apply(self, axis=axis)

    def log_softmax(self, axis=-1):
        return ops.LogSoftmax.apply(self, axis=axis)

    def masked_fill(self, mask, value):
        mask = mask._data if isinstance(mask, Tensor) else mask
        return ops.MaskedFill.apply(self, mask, value)

    # ---- shape
    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return ops.Reshape.apply(self, shape=shape)

    view = reshape

    def flatten(self, start_dim=0):
        return self.reshape(self.shape[:start_dim] + (-1,))

    def permute(self, *dims):
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        return ops.Permute.apply(self, axes=tuple(d % self.ndim for d in dims))

    def transpose(self, dim0=-2, dim1=-1):
        """Swap two axes (PyTorch's meaning; NumPy's full permutation is ``permute``)."""
        axes = list(range(self.ndim))
        dim0, dim1 = dim0 % self.ndim, dim1 % self.ndim
        axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
        return ops.Permute.apply(self, axes=tuple(axes))

    @property
    def T(self):
        return ops.Permute.apply(self, axes=tuple(reversed(range(self.ndim))))

    def split(self, split_size_or_sections, axis=0):
        return split(self, split_size_or_sections, axis)


from . import engine, ops  # noqa: E402  (ops build Tensors, so they are imported after the class)
from .creation import split  # noqa: E402  (creation.py builds on the class)

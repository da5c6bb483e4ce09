"""Function: one differentiable operation, its forward beside its backward (as in micrograd).

A subclass writes two static methods, as in torch.autograd.Function:

    class Exp(Function):
        @staticmethod
        def forward(ctx, x):              # x is a raw xp array (numpy or cupy)
            y = np.exp(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad):          # grad of the loss w.r.t. the output
            (y,) = ctx.saved_tensors
            return grad * y               # one gradient per positional input (None: no gradient)

and is called as Exp.apply(tensor). forward receives raw arrays (Tensors are unwrapped)
and returns one array; keyword arguments are non-differentiable options. ctx is the graph
node itself: parents holds, per input, the node that produced it, the leaf tensor itself, or
None (no gradient needed), and saved_tensors what forward saved.
Contract for backward: return new arrays or grad itself, never an array that something
else keeps (the engine may accumulate in place into arrays it receives).
Custom Functions are how communication enters the graph (Megatron's f and g, later).
"""
import itertools

from .. import memory
from ..backend import LOW_PRECISION, get_default_dtype
from .graph import current_saved_tensors_hooks
from .grad_mode import _state as _grad_state

_sequence = itertools.count()   # creation order; backward runs nodes newest first


def nodes_recorded():
    """Graph nodes recorded so far in this process (a step's count is the difference of two calls, less
    one: the call itself takes a number). The jobs report it per step; the planner predicts it."""
    return next(_sequence)


def _floating_result_dtype(arrays):
    """PyTorch's dtype for an op's floating result: the one floating dtype of the inputs that have
    dimensions (0-d ones count only when none of those is floating: t32 * tensor(2.0, float64) is
    float32), the default dtype when no input is floating (int / int); None where the floating inputs
    differ (then NumPy's promotion, which is PyTorch's: fp16 with fp32 is fp32)."""
    found = [None, None]          # per rank class (dimensioned, 0-d): a dtype, or False when they differ
    for a in arrays:
        dtype = getattr(a, "dtype", None)
        if dtype is not None and (dtype.kind == "f" or dtype in LOW_PRECISION):
            i = 0 if a.ndim else 1
            found[i] = dtype if found[i] is None or found[i] == dtype else False
    for dtype in found:
        if dtype is not None:
            return dtype or None
    return get_default_dtype()


class Function:
    # slots keep node creation and attribute access cheap: a GPT step builds thousands of nodes
    __slots__ = ("parents", "seq", "needs_input_grad", "_saved", "_unpack", "_saved_keys",
                 "_tracker", "_record", "_tensor_hooks", "__dict__")
    #: a floating result wider than PyTorch's dtype for it (_floating_result_dtype) is cast to that:
    #: NumPy widens bf16 * 0.5 and bf16 @ bf16 to fp32, fp32 with int64 to fp64, int / int to fp64.
    #: False where the result's dtype is the op's point (Cast) or another's (recomputation).
    keeps_input_dtype = True

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        ctx = cls.__new__(cls)
        record = False
        raw = []
        parents = []
        for a in args:
            if isinstance(a, Tensor):
                raw.append(a._data)
                if a.requires_grad:
                    record = True
                    # the edge points at the node that made the input (or at the leaf itself),
                    # never at a non-leaf tensor: intermediate outputs that no backward needs
                    # are then freed as soon as forward lets go of them
                    parents.append(a._ctx if a._ctx is not None else a)
                else:
                    parents.append(None)
            else:
                raw.append(a)
                parents.append(None)
        record = record and _grad_state.enabled
        ctx._record = record
        ctx._saved = ()
        ctx._saved_keys = None
        ctx._unpack = None
        out = cls.forward(ctx, *raw, **kwargs)
        if cls.keeps_input_dtype and out.dtype.kind == "f":
            want = _floating_result_dtype(raw)
            if want is not None and out.dtype.itemsize > want.itemsize:
                out = out.astype(want)
        result = Tensor.__new__(Tensor)
        result._data = out
        result._grad = None
        result._hooks = None
        result._post_acc_hooks = None
        if record:
            ctx.parents = parents
            ctx.needs_input_grad = tuple(p is not None for p in parents)
            ctx.seq = next(_sequence)
            ctx._tensor_hooks = None
            result._requires_grad = True
            result._ctx = ctx
        else:
            result._requires_grad = False
            result._ctx = None
        return result

    # ---- saving for backward
    def save_for_backward(self, *arrays):
        """Keep arrays for backward. Does nothing when no graph is being recorded."""
        if not self._record:
            return
        hooks = current_saved_tensors_hooks()
        if hooks is not None:
            pack, unpack = hooks
            arrays = tuple(pack(a) for a in arrays)
            self._unpack = unpack
        self._saved = arrays
        tracker = memory.tracker()
        self._tracker = tracker
        self._saved_keys = tracker.add_saved(arrays)

    @property
    def saved_tensors(self):
        if self._saved is None:
            raise RuntimeError(
                f"{type(self).__name__}: the saved arrays were freed by an earlier backward; "
                "pass retain_graph=True to the first backward to call backward twice")
        if self._unpack is not None:
            return tuple(self._unpack(a) for a in self._saved)
        return self._saved

    def release_saved(self):
        """Free what forward saved (called by backward unless retain_graph=True)."""
        if self._saved_keys:
            self._tracker.remove_saved(self._saved_keys)
        self._saved_keys = None
        self._saved = None

    def __del__(self):
        if self._saved_keys:
            self._tracker.remove_saved(self._saved_keys)

    def name(self):
        return type(self).__name__


from .tensor import Tensor  # noqa: E402  (Tensor's methods call Functions; import after the class)

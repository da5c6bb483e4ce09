"""What every collective does to its buffers: checks (op, dtype, out=), chunks, the element-wise
reduction. The collectives (rings.py, collectives.py) call these and the Communicator only."""
import numpy as np

from ..backend import LOW_PRECISION, address, array_module

OPS = ("sum", "mean", "max", "min", "prod")
#: torch.distributed.ReduceOp's names that differ from ours, for the error that meets them
TORCH_OP_NAMES = {"avg": "mean", "product": "prod"}


def chunk_bounds(n, p):
    """Start offsets of np.array_split(range(n), p), plus n: chunk i is [b[i], b[i+1])."""
    base, extra = divmod(n, p)
    bounds = [0]
    for i in range(p):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def check_array(comm, x, name):
    """A collective moves an array's buffer (NumPy's or CuPy's): anything else is refused by name, as
    torch.distributed refuses what is not a Tensor, before any rank waits for it."""
    if not all(hasattr(x, a) for a in ("nbytes", "dtype", "shape", "flags")):
        raise TypeError(f"[rank {comm.rank}] {name}: expected an array (NumPy or CuPy), got {type(x).__name__}")
    if x.dtype.hasobject:
        raise TypeError(f"[rank {comm.rank}] {name}: dtype {x.dtype} holds Python objects, whose pointers mean nothing "
                        f"in another process: send numbers (torch.distributed's *_object calls pickle objects)")


def check_op(comm, name, op, dtype):
    """``op`` is one this collective reduces ``dtype`` with: numbers only (NumPy adds strings, and would
    truncate their concatenation into the buffer); mean of floating dtypes only (an integer
    mean is not an integer), max / min not of complex ones (they have no order: MPI and PyTorch refuse
    them too); an error names the rank and the call."""
    if op not in OPS:
        torch_name = op.lower() if isinstance(op, str) else None
        hint = (f" (PyTorch's ReduceOp.{torch_name.upper()} is op={TORCH_OP_NAMES[torch_name]!r})"
                if torch_name in TORCH_OP_NAMES else "")
        raise ValueError(f"[rank {comm.rank}] {name}: unknown op {op!r}: expected one of {OPS}{hint}")
    dtype = np.dtype(dtype)
    if dtype.kind not in "biufc" and dtype not in LOW_PRECISION:
        raise TypeError(f"[rank {comm.rank}] {name}: op={op!r} reduces numbers, and {dtype} is not a number type (bool, "
                        f"integer, floating or complex)")
    if op == "mean" and dtype.kind not in "fc" and dtype not in LOW_PRECISION:
        raise TypeError(f"[rank {comm.rank}] {name}: op='mean' needs a floating dtype, got {dtype} (use 'sum')")
    if op in ("max", "min") and dtype.kind == "c":
        raise TypeError(f"[rank {comm.rank}] {name}: op={op!r} on {dtype}: complex numbers have no order")


def combine(acc, incoming, op):
    """acc = acc (op) incoming, in place (mean sums; the division comes at the end)."""
    xp = array_module(acc)
    if op in ("sum", "mean"):
        xp.add(acc, incoming, out=acc)
    elif op == "prod":
        xp.multiply(acc, incoming, out=acc)
    elif op == "max":
        xp.maximum(acc, incoming, out=acc)
    else:
        xp.minimum(acc, incoming, out=acc)


def finish_mean(a, op, p):
    if op == "mean":
        a /= p


def flat_view(x):
    xp = array_module(x)
    return xp.ascontiguousarray(x).reshape(-1)


def check_out(comm, name, out, shape, like):
    """``out`` must be a contiguous, writeable array of ``shape``, of ``like``'s dtype, on ``like``'s device,
    not overlapping it: checked on the calling thread, before a sequence number or a byte is spent."""
    if out is None:
        return
    xp = array_module(like)
    problems = []
    if not hasattr(out, "shape") or array_module(out) is not xp:
        problems.append(f"it is a {type(out).__module__}.{type(out).__name__}, the input a {type(like).__module__}."
                        f"{type(like).__name__} (the same device, please)")
    else:
        if tuple(out.shape) != tuple(shape):
            problems.append(f"shape {tuple(out.shape)} instead of {tuple(shape)}")
        if out.dtype != like.dtype:
            problems.append(f"dtype {out.dtype} instead of {like.dtype}")
        if not out.flags.c_contiguous:
            problems.append("it is not contiguous")
        elif out.size and like.size and overlap(out, like):
            problems.append("it overlaps the input (the result would read its own partial sums)")
        if not getattr(out.flags, "writeable", True):
            problems.append("it is read-only")
    if problems:
        raise ValueError(f"[rank {comm.rank}] {name}: out must be a contiguous, writeable {like.dtype} array of shape "
                         f"{tuple(shape)} on the input's device, apart from the input: " + "; ".join(problems))


def overlap(a, b):
    """Whether two contiguous arrays share bytes (their address ranges meet; either device)."""
    return address(a) < address(b) + b.nbytes and address(b) < address(a) + a.nbytes


def output_buffer(out, like, n):
    """The caller's output buffer (already checked by check_out), flat, or a new one."""
    if out is None:
        return array_module(like).empty(n, dtype=like.dtype)
    return out.reshape(-1)

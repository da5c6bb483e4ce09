"""torch.distributed's collective calls, each one of comm/'s: PyTorch's in-place results, global src / dst,
async Work and non-members' early return laid over them (see minitrain/distributed/; point to point: p2p.py)."""
import operator

from .. import comm as C
from ..autograd import Tensor
from ..backend import array_module
from ..comm.collectives import _barrier_body
from ..comm.reductions import OPS, TORCH_OP_NAMES, check_op
from .groups import ReduceOp, _group
from .work import into, run


# ---------------------------------------------------------------- arguments
def _array(t, name, what="tensor"):
    data = t.data if isinstance(t, Tensor) else t
    if not hasattr(data, "__array_interface__") and not hasattr(data, "__cuda_array_interface__"):
        raise TypeError(f"{name}: {what} must be a NumPy or CuPy array or a minitrain Tensor, got {type(t).__name__}")
    return data


def _writable(pg, name, what, arrays):
    """The arrays the call writes its result into: a read-only one is refused before anything moves (PyTorch's
    tensors are never read-only; a NumPy array may be)."""
    if any(not getattr(a.flags, "writeable", True) for a in arrays):
        raise ValueError(f"[rank {pg.ranks[pg.rank()]}] {name}: {what} is read-only, and the call writes its "
                         f"result into it")


def _op(op, name, pg, x):
    """comm's name of PyTorch's ``op``, checked against ``x``'s dtype here, so that an error names this call."""
    op = TORCH_OP_NAMES.get(op.lower(), op.lower()) if isinstance(op, str) else op
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raise ValueError(f"{name}: ReduceOp.{op.upper()} is not supported here (nor by NCCL); on bool tensors "
                         f"MIN is a logical and, MAX a logical or")
    if op not in OPS:
        raise ValueError(f"{name}: op {op!r} is not one of ReduceOp.SUM, AVG, PRODUCT, MIN, MAX")
    check_op(pg.comm, name, op, x.dtype)
    return op


def _peer(pg, name, global_rank, group_rank, what):
    """The group rank of ``src`` / ``dst`` (global) or ``group_src`` / ``group_dst`` (exactly one given)."""
    if (global_rank is None) == (group_rank is None):
        raise ValueError(f"{name}: give {what} (a global rank) or group_{what} (a rank in the group), one of them")
    if group_rank is None:
        if global_rank not in pg.ranks:
            raise ValueError(f"{name}: {what}={global_rank} is not a rank of the group {pg.ranks}")
        return pg.ranks.index(global_rank)
    if not 0 <= group_rank < pg.size():
        raise ValueError(f"{name}: group_{what}={group_rank} is not a rank of a group of size {pg.size()}")
    return group_rank


def _only_at_root(pg, name, root, given, what, role):
    """PyTorch's rule for gather's and scatter's lists: the root passes ``what``, every other rank None."""
    if (pg.rank() == root) != (given is not None):
        raise ValueError(f"{name}: {what} is the {role}'s alone (rank {pg.ranks[root]} passes it, the others None)")


def _flat(arrays):
    """The arrays' elements one after another (the list calls' single message)."""
    return array_module(arrays[0]).concatenate([a.reshape(-1) for a in arrays])


def _fill(outs):
    """finish= that writes a flat result into ``outs`` one after another, each its own size and shape."""
    def finish(flat):
        start = 0
        for o in outs:
            o[...] = flat[start:start + o.size].reshape(o.shape)
            start += o.size
    return finish


def _same(name, arrays, like, what):
    for a in arrays:
        if a.dtype != like.dtype or array_module(a) is not array_module(like):
            raise TypeError(f"{name}: every tensor of {what} must be a {like.dtype} array on the input's device, "
                            f"got {a.dtype}")


# ---------------------------------------------------------------- collectives
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _group(group, "all_reduce")
    if pg is None:
        return None
    x = _array(tensor, "all_reduce")
    _writable(pg, "all_reduce", "tensor", [x])
    op = _op(op, "all_reduce", pg, x)
    return run(async_op, lambda a: C.all_reduce(pg.comm, x, op=op, async_op=a), into(x))


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    pg = _group(group, "broadcast")
    if pg is None:
        return None
    x, root = _array(tensor, "broadcast"), _peer(pg, "broadcast", src, group_src, "src")
    _writable(pg, "broadcast", "tensor", [x] if pg.rank() != root else [])
    buf = x if x.flags.c_contiguous else array_module(x).ascontiguousarray(x)
    return run(async_op, lambda a: C.broadcast(pg.comm, buf, root=root, async_op=a),
               lambda _: None if buf is x else into(x)(buf))


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    pg = _group(group, "reduce")
    if pg is None:
        return None
    x, root = _array(tensor, "reduce"), _peer(pg, "reduce", dst, group_dst, "dst")
    _writable(pg, "reduce", "tensor", [x] if pg.rank() == root else [])
    op = _op(op, "reduce", pg, x)
    return run(async_op, lambda a: C.reduce(pg.comm, x, root=root, op=op, async_op=a),
               lambda r: None if r is None else into(x)(r))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output = every rank's input, in rank order (output: p times the input's elements, any shape)."""
    pg = _group(group, "all_gather_into_tensor")
    if pg is None:
        return None
    out = _array(output_tensor, "all_gather_into_tensor", "output_tensor")
    x = _array(input_tensor, "all_gather_into_tensor")
    _same("all_gather_into_tensor", [out], x, "output_tensor")
    _writable(pg, "all_gather_into_tensor", "output_tensor", [out])
    if out.size != pg.size() * x.size:
        raise ValueError(f"all_gather_into_tensor: output_tensor has {out.size} elements, the group's {pg.size()} "
                         f"inputs of {x.size} need {pg.size() * x.size}")
    return run(async_op, lambda a: C.ring_all_gather(pg.comm, x, total=out.size, async_op=a), into(out))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    pg = _group(group, "all_gather")
    if pg is None:
        return None
    x, outs = _array(tensor, "all_gather"), [_array(t, "all_gather", "tensor_list") for t in tensor_list]
    _same("all_gather", outs, x, "tensor_list")
    _writable(pg, "all_gather", "a tensor of tensor_list", outs)
    if len(outs) != pg.size() or any(o.shape != x.shape for o in outs):
        raise ValueError(f"all_gather: tensor_list must hold {pg.size()} tensors of shape {tuple(x.shape)}, got "
                         f"{[tuple(o.shape) for o in outs]}")
    return run(async_op, lambda a: C.ring_all_gather(pg.comm, x, total=pg.size() * x.size, async_op=a), _fill(outs))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """output = block r (of p equal ones, in element order) of the reduction of every rank's input."""
    pg = _group(group, "reduce_scatter_tensor")
    if pg is None:
        return None
    out, x = _array(output, "reduce_scatter_tensor", "output"), _array(input, "reduce_scatter_tensor", "input")
    _same("reduce_scatter_tensor", [out], x, "output")
    _writable(pg, "reduce_scatter_tensor", "output", [out])
    if x.size != pg.size() * out.size:
        raise ValueError(f"reduce_scatter_tensor: input has {x.size} elements, the group's {pg.size()} outputs "
                         f"of {out.size} need {pg.size() * out.size}")
    op = _op(op, "reduce_scatter_tensor", pg, x)
    return run(async_op, lambda a: C.ring_reduce_scatter(pg.comm, x, op=op, async_op=a), into(out))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _group(group, "reduce_scatter")
    if pg is None:
        return None
    out = _array(output, "reduce_scatter", "output")
    _writable(pg, "reduce_scatter", "output", [out])
    ins = [_array(t, "reduce_scatter", "input_list") for t in input_list]
    if len(ins) != pg.size() or any(i.shape != out.shape for i in ins):
        raise ValueError(f"reduce_scatter: input_list must hold {pg.size()} tensors of the output's shape "
                         f"{tuple(out.shape)}, got {[tuple(i.shape) for i in ins]}")
    _same("reduce_scatter", ins, out, "input_list")
    return reduce_scatter_tensor(out, _flat(ins), op=op, group=pg, async_op=async_op)


def _rows(x, output_split_sizes, input_split_sizes):
    """How many rows all_to_all_single receives, where this rank can tell before any moves (else None)."""
    if output_split_sizes is not None:
        try:
            return sum(operator.index(s) for s in output_split_sizes)
        except TypeError:
            return None          # comm's all_to_all_single names what is wrong with them
    return x.shape[0] if input_split_sizes is None and x.ndim else None


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    pg = _group(group, "all_to_all_single")
    if pg is None:
        return None
    out, x = _array(output, "all_to_all_single", "output"), _array(input, "all_to_all_single", "input")
    _same("all_to_all_single", [out], x, "output")
    _writable(pg, "all_to_all_single", "output", [out])
    rows = _rows(x, output_split_sizes, input_split_sizes)
    if rows is not None and tuple(out.shape) != (rows,) + tuple(x.shape[1:]):
        raise ValueError(f"all_to_all_single: output has shape {tuple(out.shape)}; what the splits receive "
                         f"needs {(rows,) + tuple(x.shape[1:])}")

    def finish(received):
        if received.shape != out.shape:
            raise ValueError(f"[rank {pg.comm.rank}] all_to_all_single: {tuple(received.shape)} arrived, the output "
                             f"is {tuple(out.shape)}")
        out[...] = received
    return run(async_op, lambda a: C.all_to_all_single(pg.comm, x, output_split_sizes, input_split_sizes,
                                                        async_op=a), finish)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    pg = _group(group, "all_to_all")
    if pg is None:
        return None
    outs = [_array(t, "all_to_all", "output_tensor_list") for t in output_tensor_list]
    ins = [_array(t, "all_to_all", "input_tensor_list") for t in input_tensor_list]
    if len(outs) != pg.size() or len(ins) != pg.size():
        raise ValueError(f"all_to_all: both lists must hold {pg.size()} tensors, got {len(outs)} and {len(ins)}")
    _same("all_to_all", outs + ins[1:], ins[0], "both lists")
    _writable(pg, "all_to_all", "a tensor of output_tensor_list", outs)
    flat = _flat(ins)
    return run(async_op, lambda a: C.all_to_all_single(pg.comm, flat, [o.size for o in outs], [i.size for i in ins],
                                                        async_op=a), _fill(outs))


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    pg = _group(group, "gather")
    if pg is None:
        return None
    root = _peer(pg, "gather", dst, group_dst, "dst")
    _only_at_root(pg, "gather", root, gather_list, "gather_list", "destination")
    x = _array(tensor, "gather")
    _writable(pg, "gather", "a tensor of gather_list", [_array(t, "gather", "gather_list") for t in gather_list or []])
    return all_gather(gather_list or [array_module(x).empty_like(x)] * pg.size(), tensor, pg, async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    pg = _group(group, "scatter")
    if pg is None:
        return None
    root, x = _peer(pg, "scatter", src, group_src, "src"), _array(tensor, "scatter")
    _writable(pg, "scatter", "tensor", [x])
    _only_at_root(pg, "scatter", root, scatter_list, "scatter_list", "source")
    if scatter_list is not None:
        ins = [_array(t, "scatter", "scatter_list") for t in scatter_list]
        if len(ins) != pg.size() or any(i.shape != x.shape for i in ins):
            raise ValueError(f"scatter: scatter_list must hold {pg.size()} tensors of shape {tuple(x.shape)}")
        _same("scatter", ins, x, "scatter_list")
        whole = _flat(ins)
    else:
        whole = array_module(x).empty(pg.size() * x.size, x.dtype)
    r = pg.rank()
    return run(async_op, lambda a: C.broadcast(pg.comm, whole, root=root, async_op=a),
               lambda _: into(x)(whole[r * x.size:(r + 1) * x.size]))


def barrier(group=None, async_op=False, device_ids=None):
    pg = _group(group, "barrier")
    if pg is None:
        return None
    return run(async_op, lambda a: pg.comm.launch("barrier", _barrier_body, (), a, {}, 0), lambda _: None)

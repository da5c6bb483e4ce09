"""Grader: the learner's ShardedUnit (FSDP's unit) at p = 1..4 on three parameters of 22 elements
in all (padding needed at p = 3, 4): at rest only a shard of ceil(N/p) elements, not a view into a
full buffer; gather returns every parameter exactly, as views of one gathered buffer; free drops it
and a second gather works; reduce_scatter gives this rank's shard of the averaged gradient (1e-12);
one SGD step through the unit equals minitrain's FullyShardedDataParallel's shard; and the
traffic of one all-gather / one reduce-scatter, (p-1)·S elements each."""
import numpy as np

from ..comparing import compare, host, is_array, kind_of_array, to_learner
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "FSDP's unit: shard at rest, gather for compute, free, reduce-scatter the gradients"
ORDER = 110
KIND = "implement"
NOTEBOOK = "04_zero"
DEFINES = "ShardedUnit"
SHAPES = ((3, 5), (5,), (2,))      # 22 elements

STUB = '''"""Exercise fsdp_unit: one unit of FullyShardedDataParallel (ZeRO stage 3; Zhao et al. 2023,
"PyTorch FSDP"): a layer's parameters live sharded over the ranks, and are whole only while the
layer computes.

The unit's parameters are flattened (in order) into one buffer of N elements, padded with zeros
to S·p, S = ceil(N/p); rank r owns the slice [r·S, (r+1)·S).

Write the class ShardedUnit(comm, arrays) (arrays: the unit's parameters as NumPy arrays, the same
on every rank) with:
  self.shard           this rank's S elements, its own array: keeping a view into a full buffer
                       would keep the whole buffer alive, and the point is to keep 1/p of it;
  self.full            the gathered S·p buffer while the unit is gathered, else None;
  gather()             all-gather the shards into self.full and return the parameters as a list of
                       arrays shaped like the originals, views into self.full (no copies);
  free()               drop the gathered buffer (self.full = None);
  reduce_scatter(grads)  grads: this rank's gradients, one array per parameter; return this rank's
                       S elements of the AVERAGE over the ranks of the flattened, padded gradients.

Communicate with minitrain.comm.ring_all_gather(comm, shard, total=...) and
minitrain.comm.ring_reduce_scatter(comm, x, op=...).

The test to pass: at p = 1, 2, 3, 4 (N = 22: padding at p = 3 and 4) the shard at rest, gather
exact and made of views, free then gather again, reduce_scatter equal to the average (1e-12), and
the traffic of one all-gather / one reduce-scatter, (p-1)·S elements each; then one SGD step of a
Linear layer through your unit equals minitrain's FullyShardedDataParallel.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check fsdp_unit mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check fsdp_unit mine.py
Stuck?     python -m minitrain.exercises hint fsdp_unit
"""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


class ShardedUnit:
    def __init__(self, comm, arrays):
        raise NotImplementedError("ShardedUnit: keep only this rank's shard")

    def gather(self):
        raise NotImplementedError("ShardedUnit.gather")

    def free(self):
        raise NotImplementedError("ShardedUnit.free")

    def reduce_scatter(self, grads):
        raise NotImplementedError("ShardedUnit.reduce_scatter")
'''

HINTS = (
    "__init__: remember the shapes and sizes, build the padded flat buffer once (np.zeros(S * p), "
    "then np.concatenate of the flattened arrays into its start), keep a COPY of your slice as "
    "self.shard and let the buffer go; self.full = None. With the padding, np.array_split of S·p "
    "elements gives rank r exactly [r·S, (r+1)·S).",
    "gather: self.full = ring_all_gather(comm, self.shard, total=S * p); then walk the shapes with an "
    "offset: self.full[offset:offset + size].reshape(shape) is a view. free: self.full = None. "
    "reduce_scatter: flatten and pad the gradients like the parameters, then a reduce-scatter.",
    "reduce_scatter(grads): flat = np.zeros(S * p); flat[:N] = np.concatenate([g.reshape(-1) for g in "
    "grads]); return ring_reduce_scatter(comm, flat, op='mean'). A sum instead of the mean makes "
    "every gradient p times too large.",
)


def _arrays():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s) for s in SHAPES]


def _grads(rank):
    """Rank ``rank``'s gradients, where the code under test runs."""
    rng = np.random.default_rng([1, rank])
    return [to_learner(rng.standard_normal(s)) for s in SHAPES]


def _owner(a):
    """The array that owns ``a``'s memory (a view's base, followed to the end; NumPy and CuPy alike)."""
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _rank(comm, impl, part):
    p, r = comm.size, comm.rank
    n = sum(int(np.prod(s)) for s in SHAPES)
    s = -(-n // p)
    where = f"p={p}, rank {r}"
    originals = _arrays()
    unit = impl(comm, [to_learner(a) for a in originals])
    if part == "rest":
        shard = getattr(unit, "shard", None)
        if not is_array(shard):
            raise Mismatch(f"{where}: self.shard is {type(shard).__name__}, expected {kind_of_array()}")
        padded = np.zeros(s * p)
        padded[:n] = np.concatenate([a.reshape(-1) for a in originals])
        problem = compare(shard, padded[r * s:(r + 1) * s], f"{where}: self.shard (S = ceil({n}/{p}) = {s})")
        if problem:
            raise Mismatch(problem + " (rank r's shard is [r·S, (r+1)·S) of the zero-padded flat buffer)")
        base = _owner(shard)
        if base is not shard and getattr(base, "size", 0) > s:
            raise Mismatch(f"{where}: self.shard is a view into an array of {base.size} elements: that whole "
                           "array stays in memory. Keep a copy of the shard (.copy())")
        if getattr(unit, "full", "missing") is not None:
            raise Mismatch(f"{where}: self.full is not None after __init__: at rest a unit holds its shard only")
    if part in ("gather", "free", "traffic"):
        sent0 = comm.stats.bytes_sent
        params = unit.gather()
        gather_bytes = comm.stats.bytes_sent - sent0
        _check_gathered(unit, params, originals, where, s * p)
        if part == "free":
            unit.free()
            if getattr(unit, "full", None) is not None:
                raise Mismatch(f"{where}: self.full is still set after free(): the gathered buffer stays in memory")
            params = unit.gather()
            _check_gathered(unit, params, originals, where + ", second gather (after free)", s * p)
            unit.free()
        if part == "traffic" and p > 1:
            sent0 = comm.stats.bytes_sent
            unit.reduce_scatter(_grads(r))
            scatter_bytes = comm.stats.bytes_sent - sent0
            bound = (p - 1) * s * 8
            if gather_bytes > bound or scatter_bytes > bound:
                raise Mismatch(f"{where}: gather sent {gather_bytes} bytes, reduce_scatter {scatter_bytes}; one ring "
                               f"all-gather / reduce-scatter of S·p = {s * p} float64 sends (p-1)·S·8 = {bound}")
    if part == "grads":
        got = unit.reduce_scatter(_grads(r))
        flat = np.zeros((p, s * p))
        for q in range(p):
            flat[q, :n] = np.concatenate([host(g).reshape(-1) for g in _grads(q)])
        problem = compare(got, flat.mean(axis=0)[r * s:(r + 1) * s], f"{where}: reduce_scatter's result", ranks=p)
        if problem:
            raise Mismatch(problem + " (expected: this rank's S elements of the average over the ranks)")


def _fsdp_step(comm, impl):
    """One SGD step of a Linear(4, 3) through the learner's unit, beside FullyShardedDataParallel."""
    import minitrain as mt
    from minitrain.nn import Linear, Sequential
    from minitrain.nn import functional as F
    from minitrain.optim import SGD
    from minitrain.parallel import FullyShardedDataParallel
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    share = 8 // comm.size
    rows = slice(comm.rank * share, (comm.rank + 1) * share)
    x, y = to_learner(x[rows]), to_learner(y[rows])
    mt.manual_seed(0)
    model = Sequential(Linear(4, 3))
    model.to(np.float64)
    start = [q.data.copy() for q in model.parameters()]
    fsdp = FullyShardedDataParallel(model, comm)
    opt = SGD(fsdp.parameters(), lr=0.1)
    F.mse_loss(fsdp(x), y).backward()
    opt.step()
    library_shard = fsdp.parameters()[0].data.copy()

    unit = impl(comm, [a.copy() for a in start])
    weight, bias = (mt.Tensor(a, requires_grad=True) for a in unit.gather())
    F.mse_loss(F.linear(mt.Tensor(x), weight, bias), mt.Tensor(y)).backward()
    shard_grad = unit.reduce_scatter([weight.grad, bias.grad])
    s = -(-15 // comm.size)
    got_shapes = getattr(unit.shard, "shape", None), getattr(shard_grad, "shape", None)
    if got_shapes != ((s,), (s,)):
        raise Mismatch(f"p={comm.size}, rank {comm.rank}, a Linear(4, 3) unit (N = 15): self.shard has shape "
                       f"{got_shapes[0]} and reduce_scatter returned {got_shapes[1]}; both must be this "
                       f"rank's S = ceil(N/p) = {s} elements of the zero-padded flat buffer")
    unit.shard -= 0.1 * shard_grad
    unit.free()
    problem = compare(unit.shard, library_shard, f"p={comm.size}, rank {comm.rank}: the shard after one SGD step "
                      "through your unit vs minitrain's FullyShardedDataParallel", ranks=comm.size)
    if problem:
        raise Mismatch(problem)


def _check_gathered(unit, params, originals, where, padded):
    if not isinstance(params, (list, tuple)) or len(params) != len(originals):
        raise Mismatch(f"{where}: gather() returned {type(params).__name__}"
                       + (f" of {len(params)}" if isinstance(params, (list, tuple)) else "")
                       + f", expected a list of {len(originals)} arrays")
    full = getattr(unit, "full", None)
    if not is_array(full) or full.size != padded:
        raise Mismatch(f"{where}: after gather(), self.full is {type(full).__name__}"
                       + (f" of {full.size} elements" if hasattr(full, "size") else "") + f", expected S·p = {padded}")
    for i, (got, want) in enumerate(zip(params, originals)):
        problem = compare(got, want, f"{where}: gathered parameter {i} {want.shape}")
        if problem:
            raise Mismatch(problem)
        if not is_array(got) or _owner(got) is not _owner(full):
            raise Mismatch(f"{where}: gathered parameter {i} is a copy, not a view into self.full (a copy doubles "
                           "the unit's memory while it computes)")


def checks():
    out = []
    for p in (1, 2, 3, 4):
        out += [Check(f"p={p}: at rest: a shard of ceil(N/p) elements, its own array", lambda f, p=p: run_ranks(p, _rank, f, "rest"), 1),
                Check(f"p={p}: gather: every parameter, as views of one buffer", lambda f, p=p: run_ranks(p, _rank, f, "gather"), 2),
                Check(f"p={p}: free drops the buffer; gather works again", lambda f, p=p: run_ranks(p, _rank, f, "free"), 2),
                Check(f"p={p}: reduce_scatter: this rank's shard of the averaged gradient",
                      lambda f, p=p: run_ranks(p, _rank, f, "grads"), 3)]
        out.append(Check(f"p={p}: one SGD step through the unit equals minitrain's FullyShardedDataParallel",
                         lambda f, p=p: run_ranks(p, _fsdp_step, f), 3))
        if p > 1:
            out.append(Check(f"p={p}: traffic: (p-1)·S elements per gather and per reduce-scatter",
                             lambda f, p=p: run_ranks(p, _rank, f, "traffic"), 2))
    return out


def reference():
    from minitrain.backend import array_module
    from minitrain.comm import ring_all_gather, ring_reduce_scatter

    class ShardedUnit:
        """FSDP's unit (minitrain/parallel/fsdp.py) reduced to its four moves, on the library's collectives."""

        def __init__(self, comm, arrays):
            self.comm, self.shapes = comm, [a.shape for a in arrays]
            self.xp = array_module(arrays[0])            # NumPy on the CPU, CuPy on the GPU
            self.numel = sum(a.size for a in arrays)
            self.shard_size = -(-self.numel // comm.size)
            flat = self.xp.zeros(self.shard_size * comm.size, arrays[0].dtype)
            flat[:self.numel] = self.xp.concatenate([a.reshape(-1) for a in arrays])
            lo = comm.rank * self.shard_size
            self.shard = flat[lo:lo + self.shard_size].copy()
            self.full = None

        def gather(self):
            self.full = ring_all_gather(self.comm, self.shard, total=self.shard_size * self.comm.size)
            out, offset = [], 0
            for shape in self.shapes:
                size = int(np.prod(shape))
                out.append(self.full[offset:offset + size].reshape(shape))
                offset += size
            return out

        def free(self):
            self.full = None

        def reduce_scatter(self, grads):
            flat = self.xp.zeros(self.shard_size * self.comm.size, grads[0].dtype)
            flat[:self.numel] = self.xp.concatenate([g.reshape(-1) for g in grads])
            return ring_reduce_scatter(self.comm, flat, op="mean")
    return ShardedUnit

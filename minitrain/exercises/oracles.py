"""The library's own oracles, wrapped so that a failure reads as an explanation.

Collectives: minitrain.comm.checks' inputs (integer-valued, so every order of additions is exact),
lengths (0, 1, fewer than p, not divisible by p, a few thousand) and dtypes, compared bit for bit;
bytes and messages from comm.stats against the algorithm's formula. Gradients: central
differences (minitrain.testing.numerical_grad), minitrain's own ops, and PyTorch where installed. Pipelines: a
PipelineParallel's step on ThreadWorld against one process's on the whole batch.
"""
import importlib.util

import numpy as np

from minitrain.comm.checks import COLLECTIVE_DTYPES, collective_lengths, expected_reduction, rank_input

from .comparing import alias_problem, as_array, compare, host, to_learner
from .grading import Check, Mismatch, Skipped, untimed
from .harness import run_ranks

WORLD_SIZES = (1, 2, 3, 4)
OPS = ("sum", "mean", "max", "min")


def has_torch():
    return importlib.util.find_spec("torch") is not None


def need_torch():
    if not has_torch():
        raise Skipped("PyTorch is not installed (pip install torch): this oracle was skipped")
    with untimed():
        import torch
    return torch


def _inputs_at(p, n, dtype, index):
    return ", ".join(f"{rank_input(r, n, dtype)[index]:g}" for r in range(p))


def cases(p, ops=OPS, dtypes=COLLECTIVE_DTYPES):
    """(n, dtype, op): every length and dtype for "sum", two dtypes for the other ops; lengths with
    several chunks first (their errors say the most), then 0, 1, fewer than p."""
    lengths = collective_lengths(p)
    lengths = [13 * p + 1] + [n for n in lengths if n != 13 * p + 1]
    for op in ops:
        for n in lengths:
            for dtype in (dtypes if op == "sum" else [d for d in ("float64", "int32") if d in dtypes]):
                if op == "mean" and np.dtype(dtype).kind != "f":
                    continue
                yield n, dtype, op


def check_reduction(comm, got, x, before, n, dtype, op, name, keep=None):
    """``got`` must be the reduction over the ranks (or, with ``keep(full) -> part``, this rank's part)."""
    p, r = comm.size, comm.rank
    case = f"rank {r} of {p}, {name}(n={n}, {dtype}, op={op!r})"
    given, x, before = x, host(x), host(before)
    if not np.array_equal(x, before):
        raise Mismatch(f"{case}: your function modified its input x; return a new array instead")
    aliased = alias_problem(got, given, case, "the input x")
    if aliased:
        raise Mismatch(aliased)
    got = as_array(got, case)
    full = expected_reduction(p, n, dtype, op)
    want = full if keep is None else keep(full)
    if got.dtype != want.dtype:
        raise Mismatch(f"{case}: returned dtype {got.dtype}, expected {want.dtype} (the input's)")
    problem = compare(got, want, case, exact=True, chunks=p if keep is None else None,
                      ranks=p if op == "mean" else None)
    if problem:
        if keep is None and got.shape == want.shape:
            wrong = np.flatnonzero(~(got.astype(np.float64) == want.astype(np.float64)))
            if wrong.size:
                i = wrong[0]
                problem += f". The ranks' inputs at element {i}: {_inputs_at(p, n, dtype, i)}"
                if p > 1 and got[i] == x[i]:
                    problem += " (your value there is this rank's own input: nothing was combined into it)"
        raise Mismatch(problem)


def traffic(comm, fn):
    """(bytes, messages) this rank sends while ``fn()`` runs."""
    b0, m0 = comm.stats.bytes_sent, comm.stats.messages_sent
    fn()
    return comm.stats.bytes_sent - b0, comm.stats.messages_sent - m0


def world_checks(steps, sizes=WORLD_SIZES):
    """Checks on ThreadWorld(p) for every p in ``sizes``, p by p: ``steps`` is a list of
    (label, body, hint, smallest p); ``body(comm, impl)`` runs on every rank."""
    def make(p, body):
        return lambda impl: run_ranks(p, body, impl)
    return [Check(f"p={p}: {label}", make(p, body), hint)
            for p in sizes for label, body, hint, smallest in steps if p >= smallest]


# ---------------------------------------------------------------- gradients
def numerical(f, array):
    """Central differences of the scalar f() with respect to every entry of ``array``."""
    from minitrain.testing import numerical_grad
    return numerical_grad(f, array)


def expect_grad(got, want, what, atol=1e-6, rtol=1e-5):
    """The learner's gradient against an oracle (central differences: 1e-6; exact ops: tighter)."""
    problem = compare(got, want, what, rtol=rtol, atol=atol)
    if problem:
        raise Mismatch(problem)


def unpack(value, count, what):
    """The learner's return value as ``count`` arrays (a tuple or list of them)."""
    if count == 1:
        return (as_array(value, what),)
    if not isinstance(value, (tuple, list)) or len(value) != count:
        got = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
        raise Mismatch(f"{what}: returned {got}, expected a tuple of {count} arrays")
    return tuple(as_array(v, f"{what}[{i}]") for i, v in enumerate(value))


def call_backward(impl, inputs, count, what, **kwargs):
    """``impl(*inputs.values(), **kwargs)`` on fresh copies where the learner's code runs, as ``count``
    host arrays; a Mismatch when it changed an input in place or returned one: autograd may hand the
    same gradient to several backward functions, so a backward leaves its inputs alone."""
    given = [to_learner(a) for a in inputs.values()]
    value = impl(*given, **kwargs)
    for (name, before), after in zip(inputs.items(), given):
        if not np.array_equal(host(after), before, equal_nan=True):
            raise Mismatch(f"{what}: your code changed its input {name} in place; leave the inputs as they "
                           "are and return new arrays (autograd may hand the same array to several backward "
                           "functions)")
    for got in value if isinstance(value, (tuple, list)) else (value,):
        for name, array in zip(inputs, given):
            problem = alias_problem(got, array, what, f"the input {name}")
            if problem:
                raise Mismatch(problem)
    return unpack(value, count, what)


# ---------------------------------------------------------------- pipeline schedules
def as_schedule(value, p, m, what, kinds="FB"):
    """The learner's schedule (p lists of ("F", i) / ("B", i), and ("W", i) when ``kinds`` is "FBW",
    or minitrain Actions) as Actions with their communication filled in, or a Mismatch saying what
    is malformed."""
    from minitrain.parallel.pipeline import Action
    if not isinstance(value, (list, tuple)) or len(value) != p:
        got = f"{len(value)} rows" if isinstance(value, (list, tuple)) else type(value).__name__
        raise Mismatch(f"{what}: expected a list of p = {p} stages (one list of actions each), got {got}")
    spelled = " or ".join(f"('{k}', i)" for k in kinds)
    schedule = []
    for s, row in enumerate(value):
        actions = []
        for k, item in enumerate(row):
            try:
                kind, mb = (item.kind, item.microbatch) if isinstance(item, Action) else (tuple(item) + (None, None))[:2]
            except TypeError:
                kind, mb = None, None
            if kind not in kinds or not isinstance(mb, (int, np.integer)) or not 0 <= mb < m:
                raise Mismatch(f"{what}: stage {s}, action #{k} is {item!r}; expected {spelled} "
                               f"with 0 <= i < m = {m}")
            before, after = (s - 1 if s > 0 else None), (s + 1 if s < p - 1 else None)
            actions.append(Action("F", int(mb), 0, before, after) if kind == "F"
                           else Action("B", int(mb), 0, after, before) if kind == "B"
                           else Action("W", int(mb), 0, None, None))
        units = sorted((a.kind, a.microbatch) for a in actions)
        if units != sorted((kind, i) for kind in kinds for i in range(m)):
            missing = sorted(set((kind, i) for kind in kinds for i in range(m)) - set(units))
            twice = sorted({u for u in units if units.count(u) > 1})
            raise Mismatch(f"{what}: stage {s} must run {', '.join(f'({k!r}, i)' for k in kinds)} once each for "
                           f"i = 0..{m - 1}; " + (f"missing {missing[:4]}" if missing else "")
                           + (f" twice: {twice[:4]}" if twice else ""))
        schedule.append(actions)
    return schedule


def simulate_schedule(impl, p, m, kinds="FB", costs=(1.0, 2.0, 0.0)):
    """(schedule, simulation) of the learner's impl(p, m), with (forward, backward, weight) costs
    (default: forward 1, backward 2, no W). The library's checker and simulator: a deadlock or a
    broken happens-before is a Mismatch."""
    from minitrain.parallel.pipeline import ScheduleError, simulate
    what = f"{impl.__name__}(p={p}, m={m})" if hasattr(impl, "__name__") else f"schedule(p={p}, m={m})"
    schedule = as_schedule(impl(p, m), p, m, what, kinds)
    try:
        return schedule, simulate(schedule, *costs)
    except ScheduleError as e:
        raise Mismatch(f"{what}: {e}") from None


def one_process_step(make_model, batch):
    """(loss, name -> gradient on the host) of one mse_loss backward of make_model() on the whole batch: what a
    pipeline of the same model must reproduce."""
    from minitrain.autograd import Tensor
    from minitrain.nn import functional as F
    model, (x, y) = make_model(), batch
    loss = F.mse_loss(model(Tensor(to_learner(x))), Tensor(to_learner(y)))
    loss.backward()
    return float(host(loss.data)), {n: host(q.grad) for n, q in model.named_parameters()}


def same_grads(got, want, where, note=""):
    """Each gradient of ``got`` (name -> array) == ``want``'s (float64: 1e-10), or a Mismatch naming it (+ note)."""
    for name, grad in got.items():
        if grad is None:
            raise Mismatch(f"{where}: {name}.grad is None; one backward gives it a gradient")
        problem = compare(grad, want[name], f"{where}: {name}.grad", rtol=1e-10, atol=1e-12)
        if problem:
            raise Mismatch(problem + note)


def pipeline_matches_one_process(p, schedule, make_model, batch, where, reference=None, split_points=None, note=""):
    """A p-stage PipelineParallel of make_model() (4 micro-batches; cut at split_points, or by its counted costs)
    trains one step on ThreadWorld: on every rank its loss and each gradient == one process's step of reference()
    (default make_model()) on the whole batch."""
    want_loss, want = one_process_step(reference or make_model, batch)

    def rank(comm):
        from minitrain.nn import functional as F
        from minitrain.parallel.pipeline import PipelineParallel
        pipe = PipelineParallel(make_model(), comm, schedule, num_microbatches=4, split_points=split_points)
        x, y = batch
        loss = pipe.train_step(to_learner(x), to_learner(y), F.mse_loss)
        return float(host(loss)), {n: host(q.grad) for n, q in pipe.named_parameters()}
    for r, (loss, grads) in enumerate(run_ranks(p, rank)):
        if abs(loss - want_loss) > 1e-10:
            raise Mismatch(f"{where}, rank {r}: loss {loss}, one process's {want_loss}")
        same_grads(grads, want, f"{where}, rank {r}", note)


# ---------------------------------------------------------------- context parallelism
def zigzag_indices(seq_len, cp, rank):
    """The positions rank ``rank`` of ``cp`` holds under ring attention's zig-zag split (Llama 3,
    Dubey et al. 2024, sec. 3.3.2: the sequence cut into 2·cp chunks, rank i holds chunks i and
    2·cp-1-i), in that order: a rank's early chunk has little causal work, its late one much."""
    if seq_len % (2 * cp):
        raise ValueError(f"zigzag_indices: a sequence of {seq_len} tokens does not split into 2*cp = {2 * cp} "
                         "equal chunks")
    c = seq_len // (2 * cp)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def causal_pairs(positions):
    """(query, key) pairs with key <= query that the queries at ``positions`` attend to."""
    return int(np.sum(np.asarray(positions, dtype=np.int64) + 1))


def causal_blocks(positions, seq_len, blocks):
    """Attention blocks a rank computes when the sequence is cut into ``blocks`` blocks (ring
    attention's unit): block (i, j) for every query block i it holds and every key block j <= i."""
    held = np.unique(np.asarray(positions, dtype=np.int64) // (seq_len // blocks))
    return int(np.sum(held + 1))


# ---------------------------------------------------------------- the paged KV cache
class RecordingBlockPool:
    """A block pool as the paged KV cache's BlockPool: allocate() hands out the lowest free block,
    refcount, copy, release, share; each block keeps what was written into it (offset -> label), so
    that a grader can read a sequence back through its table."""

    def __init__(self, num_blocks=64):
        self.refcount = np.zeros(num_blocks, dtype=np.int64)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.contents, self.log = {}, []

    def allocate(self):
        if not self.free:
            raise Mismatch(f"the pool's {len(self.refcount)} blocks are all taken: blocks are allocated that no "
                           "token needs, or never released")
        b = self.free.pop()
        self.refcount[b], self.contents[b] = 1, {}
        self.log.append(("allocate", b))
        return b

    def copy(self, src, dst):
        src, dst = _block_id(src, "pool.copy's src"), _block_id(dst, "pool.copy's dst")
        self.log.append(("copy", src, dst))
        self.contents[dst] = dict(self.contents.get(src, {}))

    def release(self, b):
        b = _block_id(b, "pool.release's block")
        if self.refcount[b] < 1:
            raise Mismatch(f"pool.release({b}): block {b} is held by no table (refcount 0): released twice, or "
                           "never allocated")
        self.refcount[b] -= 1
        self.log.append(("release", b))
        if self.refcount[b] == 0:
            self.free.append(b)

    def share(self, b):
        self.refcount[b] += 1

    def held(self):
        return len(self.refcount) - len(self.free)


def _block_id(b, what):
    try:
        return int(b)
    except (TypeError, ValueError):
        raise Mismatch(f"{what} is {b!r}, expected a block id (an int)") from None

"""Grader: PyTorch's DistributedSampler layout and minitrain's global batches, given the epoch's
permutation. n divisible by p and not, n < p, n = 1, drop_last or not: every rank's share the same
length; the padding the permutation's start; == minitrain's DistributedSampler and PyTorch's (where
installed). Global batches: shares together == one process's batch, rows, the last partial one, start."""
from collections import Counter

import numpy as np

from ...data import DistributedSampler
from ..comparing import host_all
from ..grading import Check, Mismatch, untimed
from ..oracles import need_torch

TITLE = "DistributedSampler: each rank every p-th index of one padded permutation; global batches shared exactly"
ORDER = 85
KIND = "implement"
NOTEBOOK = "03_data_parallel"
DEFINES = ("shard", "global_batch_shard")

STUB = '''"""Exercise distributed_sampler: data parallelism gives each of p ranks its share of an epoch.
PyTorch's DistributedSampler (torch.utils.data.distributed) draws one permutation of the n sample
indices per epoch, the same on every rank (seeded by seed and epoch, never by the rank), and deals
it out like cards: rank r takes every p-th index, starting at r. Every rank must take the same
number of steps (each step's all-reduce waits for all of them), so when p does not divide n the
permutation is first padded by repeating its start (or, with drop_last, cut to a multiple of p).
minitrain's jobs share out global batches instead: the unpadded permutation cut into batches of
batch_size, each dealt out the same way, so that p ranks see exactly what one process sees.

Write both. order is the epoch's permutation, a 1-D NumPy array of the n indices (indices stay on
the host, as in minitrain's sampler); p is num_replicas; leave order as it is.

shard(order, num_replicas, rank, drop_last=False): this rank's indices, in PyTorch's layout.
  - total_size = ceil(n / p) * p; with drop_last, floor(n / p) * p;
  - the order padded to total_size by repeating it from its start, as many times as it takes
    (n = 2 on p = 5 ranks: o0 o1 o0 o1 o0), or, with drop_last, cut to its first total_size;
  - rank r takes positions r, r + p, r + 2p, ... of that: a 1-D integer array, total_size / p long.

global_batch_shard(order, batch_size, num_replicas, rank, start=0): yield, for each global batch
of the unpadded order from batch number start on, (this rank's indices, the global batch's rows).
  - global batch j is order[j * batch_size : (j + 1) * batch_size]; the last one may be partial;
  - rank r takes every p-th index of it, starting at r; a rank with none yields its empty share
    too (every rank takes every step);
  - rows is the global batch's size, the same on every rank: each rank's mean loss weighted by its
    rows over these (share_loss) makes the ranks' mean one process's loss on the batch.

The test to pass, for n divisible by p and not, n < p, n = 1, with and without drop_last: every
rank's share the same length; together every sample, padded with the order's start (drop_last:
each kept sample once); == minitrain's and PyTorch's DistributedSampler (shuffle=False). Each global
batch's shares together == one process's batch, rows its size, the last partial one too; start=k
resumes at global batch k.

Check it:  python -m minitrain.exercises check distributed_sampler mine.py
Stuck?     python -m minitrain.exercises hint distributed_sampler
"""
import numpy as np


def shard(order, num_replicas, rank, drop_last=False):
    raise NotImplementedError("shard: pad (or cut) the order to a multiple of num_replicas, then stride")


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    raise NotImplementedError("global_batch_shard: cut the unpadded order into global batches, stride each")
'''

HINTS = (
    "Pad first, then deal. Dealing the unpadded order gives the first n % p ranks one index more than the "
    "others, and a rank with one more step than the rest waits forever in that step's all-reduce. total_size "
    "= -(-n // p) * p (ceil), or n // p * p with drop_last, where the order is simply cut: order[:total_size].",
    "The padding is the order's start: order followed by order[:total_size - n]. When the padding is longer "
    "than the order (n = 2 on 5 ranks) one copy is not enough: np.tile(order, reps)[:total_size] with reps = "
    "ceil(total_size / n) (np.resize(order, total_size) does the same). Then padded[rank::num_replicas]: a "
    "stride, not the block padded[rank * k:(rank + 1) * k].",
    "global_batch_shard pads nothing: for begin in range(start * batch_size, len(order), batch_size): batch = "
    "order[begin:begin + batch_size]; yield batch[rank::num_replicas], len(batch). Padding would put the "
    "epoch's first samples into its last step a second time.",
)


CASES = [(n, p, drop, (n // p if drop else -(-n // p)) * p, f"n={n}, num_replicas={p}, drop_last={drop}")
         for n, p in ((13, 4), (12, 4), (7, 3), (5, 4), (2, 5), (3, 8), (1, 3), (1, 1), (6, 1), (50, 6))
         for drop in (False, True)]                # (n, p, drop_last, total_size, the case in words)
BATCHES = ((13, 4, 2), (12, 4, 2), (10, 3, 4), (2, 4, 5), (7, 7, 3), (1, 2, 3), (23, 6, 4), (9, 4, 1))  # (n, B, p)
HANGS = ("a rank with more steps than the others waits in an all-reduce they never call (they have finished "
         "the epoch): DDP hangs")


def _sampler(n, p=1, r=0, seed=3, drop_last=False):
    """minitrain's DistributedSampler, epoch 0 (its permutation(): the order the learner is given)."""
    return DistributedSampler(n, num_replicas=p, rank=r, seed=seed, drop_last=drop_last)


def _show(a, most=12):
    a = [int(i) for i in a]
    return str(a) if len(a) <= most else f"[{', '.join(map(str, a[:most]))}, ... ({len(a)} in all)]"


def _indices(value, what):
    got = host_all(value)
    try:
        a = np.asarray(got)
    except (TypeError, ValueError):
        a = None
    if a is None or a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise Mismatch(f"{what}: returned {type(got).__name__} {got!r:.60}, expected a 1-D array of integer indices")
    return a.astype(np.int64)


def _untouched(given, order, what):
    if not np.array_equal(given, order):
        raise Mismatch(f"{what} changed order in place; leave it as it is (it is the epoch's permutation, the "
                       "same for every rank and every call)")


def _shard(impl, order, p, r, drop_last):
    what = f"shard(order of n={len(order)}, num_replicas={p}, rank={r}, drop_last={drop_last})"
    given = order.copy()
    got = _indices(impl[0](given, p, r, drop_last=drop_last), what)
    _untouched(given, order, what)
    return got, what


def _lengths(impl):
    for n, p, drop_last, total, case in CASES:
        order = _sampler(n).permutation()
        lengths, k = [len(_shard(impl, order, p, r, drop_last)[0]) for r in range(p)], total // p
        rule = (f"floor(n / p) = {k}: with drop_last the order is cut to {total}, not padded" if drop_last else
                f"ceil(n / p) = {k}: the order padded to total_size = {total}, not cut (that is drop_last=True)")
        if len(set(lengths)) == 1 and lengths != [k] * p:
            raise Mismatch(f"{case}: every rank got {lengths[0]} indices, expected {rule}")
        if len(set(lengths)) > 1:
            why = ("; these are the unpadded order's strides: pad to total_size first, then stride"
                   if lengths == [len(order[r::p]) for r in range(p)] else "")
            why += (f"; the padding ({total - n}) is longer than the order ({n}): repeat the order as many times as "
                    "it takes" if total - n > n else "")
            raise Mismatch(f"{case}: the ranks' shares have lengths {lengths}; every rank needs the same number, "
                           f"{rule}; {HANGS}{why}")


def _union(impl):
    for n, p, drop_last, total, case in CASES:
        order = _sampler(n).permutation()
        got = Counter(np.concatenate([_shard(impl, order, p, r, drop_last)[0] for r in range(p)]).tolist())
        want = np.resize(order, total)                       # the order repeated from its start, cut
        if got == Counter(want.tolist()):
            continue
        extra = sorted((got - Counter(want.tolist())).elements())
        if drop_last:
            raise Mismatch(f"{case}: the shares hold {_show(sorted(got.elements()))}, expected each of the order's "
                           f"first {total} once, {_show(sorted(want))}: drop_last pads nothing and cuts the last "
                           f"n - total_size = {n - total} of the order (its tail, {_show(order[total:])})")
        missing = [int(i) for i in order if int(i) not in got]
        if missing:
            raise Mismatch(f"{case}: sample {missing[0]} (order[{int(np.flatnonzero(order == missing[0])[0])}]) is "
                           "on no rank; without drop_last every sample is seen at least once")
        named = (", the last sample repeated" if set(extra) == {int(order[-1])} else ", sample 0 repeated (zeros?)"
                 if set(extra) == {0} else ", order[0] on each short rank: padded after striding? pad the whole "
                 "order, then stride" if set(extra) == {int(order[0])} and len(extra) > 1 else "")
        raise Mismatch(f"{case}: the padding is {_show(extra)}{named}; expected the order's start repeated up to "
                       f"total_size = {total}, {_show(sorted(want[n:]))} (order[0], order[1], ..., wrapping around "
                       "when the padding is longer than the order), as PyTorch pads: not random, not the last "
                       "sample, not zeros")


def _exact(got, want, what, order, total, r, whose):
    if np.array_equal(got, want):
        return
    k, why = len(want), ""
    if np.array_equal(got, np.resize(order, total)[r * k:(r + 1) * k]):
        why = (f": this is the contiguous block padded[{r * k}:{(r + 1) * k}]; PyTorch deals the padded order out like "
               "cards, rank r at positions r, r + p, r + 2p, ...")
    elif sorted(got.tolist()) == sorted(want.tolist()):
        why = ": the right indices in another order; keep the padded order's order"
    raise Mismatch(f"{what}: got {_show(got)}, expected {_show(want)} ({whose}){why}")


def _layout(impl):
    for n, p, drop_last, total, case in CASES:
        for r in range(p):
            sampler = _sampler(n, p, r, seed=7, drop_last=drop_last)
            got, what = _shard(impl, sampler.permutation(), p, r, drop_last)
            _exact(got, sampler.indices(), what, sampler.permutation(), total, r,
                   "minitrain's DistributedSampler.indices()")


def _torch(impl):
    need_torch()
    with untimed():
        from torch.utils.data.distributed import DistributedSampler as TorchSampler
    for n, p, drop_last, total, case in CASES:
        for r in range(p):
            positions = np.array(list(TorchSampler(range(n), num_replicas=p, rank=r, shuffle=False,
                                                   drop_last=drop_last)), dtype=np.int64)
            for order in (np.arange(n), _sampler(n, seed=11).permutation()):      # a layout of positions
                got, what = _shard(impl, order, p, r, drop_last)
                _exact(got, order[positions], f"{what}, order {_show(order, 8)}", order, total, r,
                       f"PyTorch's DistributedSampler(shuffle=False) takes positions {_show(positions)}")


def _batches(impl, order, B, p, r, start=0):
    """[(this rank's share, rows)] for every global batch the learner yields, checked for shape."""
    what = (f"global_batch_shard(order of n={len(order)}, batch_size={B}, num_replicas={p}, rank={r}"
            + (f", start={start})" if start else ")"))
    given = order.copy()
    out = impl[1](given, B, p, r, start=start)
    try:
        items = list(out)
    except TypeError:
        raise Mismatch(f"{what}: returned {type(out).__name__}, expected to yield (indices, rows) pairs") from None
    bad = [item for item in items if not (isinstance(item, (tuple, list)) and len(item) == 2)]
    if bad:
        raise Mismatch(f"{what}: yielded {bad[0]!r:.60}; expected pairs (this rank's indices, the global batch's rows)")
    _untouched(given, order, what)
    return [(_indices(share, f"{what}, item {j}'s indices"), rows) for j, (share, rows) in enumerate(items)]


def _global(impl):
    for n, B, p in BATCHES:
        case, order, m = f"n={n}, batch_size={B}, num_replicas={p}", _sampler(n, seed=5).permutation(), -(-n // B)
        runs = [_batches(impl, order, B, p, r) for r in range(p)]
        counts = [len(run) for run in runs]
        if counts != [m] * p:
            why = (f"every rank takes every step, an empty share included (its zero loss still joins the "
                   f"all-reduce): {HANGS}" if len(set(counts)) > 1 else "the last partial batch is part of the epoch"
                   if counts[0] == n // B else "batch_size is the global batch, all ranks together"
                   if counts[0] == -(-n // (B * p)) else "")
            raise Mismatch(f"{case}: the ranks yield {counts} batches, expected ceil(n / batch_size) = {m} on every "
                           f"rank" + (f": {why}" if why else ""))
        library = [list(_sampler(n, p, r, seed=5).global_batches(B)) for r in range(p)]
        for j in range(m):
            want = order[j * B:(j + 1) * B]
            where = f"{case}, global batch {j} (order[{j * B}:{j * B + len(want)}])"
            union = Counter(np.concatenate([runs[r][j][0] for r in range(p)]).tolist())
            if union != Counter(want.tolist()):
                twice = sorted(i for i, c in union.items() if c > 1)
                why = (f"; sample {twice[0]} twice in one step" if twice else "") + (
                    "; the padded order was cut into global batches: its padding puts the epoch's first samples "
                    "into its last step again; share out the unpadded order"
                    if j == m - 1 and set(union - Counter(want.tolist())) <= set(order[:p].tolist()) else "")
                raise Mismatch(f"{where}: the ranks' shares together hold {_show(sorted(union.elements()))}, "
                               f"expected one process's batch {_show(sorted(want))}{why}")
            rows = [runs[r][j][1] for r in range(p)]
            if rows != [len(want)] * p:
                why = (": rows is this rank's count; it must be the global batch's (share_loss divides by it)"
                       if rows == [len(runs[r][j][0]) for r in range(p)] else ": the last batch is partial"
                       if len(want) < B else "")
                raise Mismatch(f"{where}: rows {rows} on the ranks, expected the global batch's size, {len(want)}, "
                               f"on every rank{why}")
            for r in range(p):
                if not np.array_equal(runs[r][j][0], library[r][j][0]):
                    raise Mismatch(f"{where}, rank {r}: got {_show(runs[r][j][0])}, expected "
                                   f"{_show(library[r][j][0])}, batch[rank::num_replicas], as minitrain's "
                                   "DistributedSampler.global_batches strides it (where p divides batch_size, rank "
                                   "r then holds the rows PyTorch's layout gives it)")


def _resume(impl):
    for n, B, p in BATCHES:
        order, m = _sampler(n, seed=5).permutation(), -(-n // B)
        for r in range(p):
            whole = [(share.tolist(), rows) for share, rows in _batches(impl, order, B, p, r)]
            for start in [*range(m - 1, 0, -1), m]:          # (at start=1, one batch early is start ignored)
                got = [(share.tolist(), rows) for share, rows in _batches(impl, order, B, p, r, start)]
                if got == whole[start:]:
                    continue
                samples = [(order[b:b + B][r::p].tolist(), len(order[b:b + B])) for b in range(start, n, B)]
                at = next((s for s in range(m + 1) if got == whole[s:]), None)
                why = ("start was ignored" if at == 0 else "one batch early" if at == start - 1 else "one batch "
                       "late" if at == start + 1 else "start counted in samples; it is a batch number (DataLoader's "
                       "batches_done): begin at sample start * batch_size" if got == samples else "")
                left = f"batches {start}..{m - 1} of the {m} start=0 yields" if start < m else f"none (of {m})"
                raise Mismatch(f"n={n}, batch_size={B}, num_replicas={p}, rank {r}, start={start}: yielded "
                               f"{len(got)} batch(es), expected {left}" + (f": {why}" if why else ""))


def checks():
    return [Check("every rank's share the same length: ceil(n / p), floor(n / p) with drop_last", _lengths, 1),
            Check("together the shares hold every sample, padded with the order's start (drop_last: each kept "
                  "sample once)", _union, 2),
            Check("each rank's share == minitrain's DistributedSampler.indices(), every p-th index", _layout, 2),
            Check("each rank's share == PyTorch's DistributedSampler(shuffle=False)", _torch, 2),
            Check("global batches: the shares together == one process's batch, rows == its size, the last partial "
                  "one too", _global, 3),
            Check("global batches: start=k resumes at global batch k", _resume, 3)]


def reference():
    """minitrain's DistributedSampler with the given order in place of its (seed, epoch) permutation."""
    def sampler(order, num_replicas, rank, drop_last=False):
        s = DistributedSampler(len(order), num_replicas=num_replicas, rank=rank, drop_last=drop_last)
        s.permutation = lambda: np.asarray(order)
        return s

    def shard(order, num_replicas, rank, drop_last=False):
        return sampler(order, num_replicas, rank, drop_last).indices()

    def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
        return sampler(order, num_replicas, rank).global_batches(batch_size, start=start)
    return shard, global_batch_shard

"""The same calls under torch.distributed (gloo, torch tensors) and minitrain.distributed (NumPy arrays), in one
process per rank: every result, return value and Work's answer compared, call by call. Prints "same NAME" or
"differs NAME: torch ... minitrain ..." (tests/test_distributed.py reads them). Only what gloo defines is
compared (its reduce leaves partial sums on the other ranks, its strided outputs can be wrong)."""
import datetime
import os

import numpy as np
import torch
import torch.distributed as tdist

import minitrain.distributed as mdist

rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(size))
tdist.init_process_group("gloo")
mdist.init_process_group("gloo")
r, p = rank, size


def answer(v):
    """A value both libraries' results reduce to: tensors as (dtype, shape, values)."""
    if isinstance(v, (list, tuple)):
        return [answer(x) for x in v]
    if isinstance(v, torch.Tensor):
        v = v.numpy()
    if isinstance(v, np.ndarray):
        return (v.dtype.name, v.shape, v.tolist())
    return v if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__


def compare(name, call):
    """``call(dist, T)``: T makes that library's tensor from a NumPy array; returns what to compare."""
    got = [answer(call(d, t)) for d, t in ((tdist, lambda a: torch.from_numpy(np.array(a))), (mdist, np.array))]
    print(f"same {name}" if got[0] == got[1] else f"differs {name}: torch {got[0]} minitrain {got[1]}", flush=True)


def data(dt, n=5):
    return np.array([True, r % 2 == 0, False, r == 0, True][:n]) if dt == "bool" else (np.arange(n) + r + 1).astype(dt)


def in_place(fn):
    """Call fn(x) on x and return (what it returned, x)."""
    return lambda d, x: (fn(d, x), x)


for op, dtypes in (("SUM", ("float64", "float32", "int64", "int32", "int8", "bool")), ("PRODUCT", ("int8", "bool")),
                   ("MIN", ("float64", "int32", "bool")), ("MAX", ("float32", "int64", "bool")),
                   ("AVG", ("float64", "float32"))):
    for dt in dtypes:
        compare(f"all_reduce {op} {dt}", lambda d, T: in_place(
            lambda d, x: d.all_reduce(x, op=getattr(d.ReduceOp, op)))(d, T(data(dt))))
compare("all_reduce 0-d async", lambda d, T: (lambda x, w: (w.wait(), w.is_completed(), x))(
    *(lambda x: (x, d.all_reduce(x, async_op=True)))(T(np.float64(r + 1)))))
compare("broadcast src", lambda d, T: in_place(lambda d, x: d.broadcast(x, src=p - 1))(d, T(data("int32"))))
compare("broadcast group_src", lambda d, T: in_place(lambda d, x: d.broadcast(x, group_src=1))(d, T(data("bool"))))
for dst in range(p):
    compare(f"reduce dst={dst}", lambda d, T: (lambda x: (d.reduce(x, dst=dst), x if r == dst else None))(
        T(data("float64"))))
compare("all_gather", lambda d, T: (lambda outs: (d.all_gather(outs, T(data("float32", 3))), outs))(
    [T(np.zeros(3, "float32")) for _ in range(p)]))
compare("all_gather_into_tensor", lambda d, T: (lambda o: (d.all_gather_into_tensor(o, T(data("int64", 2))), o))(
    T(np.zeros(2 * p, "int64"))))
for op in ("SUM", "MAX", "AVG"):
    compare(f"reduce_scatter_tensor {op}", lambda d, T: (lambda o: (d.reduce_scatter_tensor(
        o, T(np.arange(3.0 * p) * (r + 1)), op=getattr(d.ReduceOp, op)), o))(T(np.zeros(3))))
compare("reduce_scatter async", lambda d, T: (lambda o, w: (w.wait(), o))(*(lambda o: (o, d.reduce_scatter(
    o, [T(np.arange(3.0) + 10 * j + r) for j in range(p)], async_op=True)))(T(np.zeros(3)))))
splits = [(r + j) % 3 for j in range(p)]          # some rows to no rank
compare("all_to_all_single splits", lambda d, T: (lambda o: (d.all_to_all_single(
    o, T((np.arange(2.0 * sum(splits)) + 100 * r).reshape(-1, 2)), splits, splits), o))(T(np.zeros((sum(splits), 2)))))
compare("all_to_all_single even", lambda d, T: (lambda o: (d.all_to_all_single(o, T(np.arange(2.0 * p) + 10 * r)), o))(
    T(np.zeros(2 * p))))
compare("gather", lambda d, T: (lambda g: (d.gather(T(data("float64", 2)), g, dst=1), g))(
    [T(np.zeros(2)) for _ in range(p)] if r == 1 else None))
compare("scatter", lambda d, T: (lambda o: (d.scatter(o, [T(np.full(2, 7.0 * i)) for i in range(p)] if r == p - 1
                                                      else None, src=p - 1), o))(T(np.zeros(2))))
compare("barrier async", lambda d, T: (lambda w: (w.wait(), w.is_completed()))(d.barrier(async_op=True)))


def ring(d, T):
    got = T(np.zeros(2))
    request = d.irecv(got, src=(r - 1) % p, tag=5)
    sent = d.isend(T(np.full(2, float(r))), dst=(r + 1) % p, tag=5)
    return sent.wait(), request.wait(), got, d.recv(got, src=0) if r == p - 1 else d.send(got, dst=p - 1) if r == 0 \
        else None


compare("isend / irecv / recv", ring)


def groups(d, T):
    unsorted, given = d.new_group([p - 1, 0]), d.new_group([p - 1, 0], sort_ranks=False)
    singles = [d.new_group([q]) for q in range(p)]
    x = T(np.full(2, float(r + 1)))
    answers = [d.get_backend(), d.get_rank(unsorted), d.get_world_size(unsorted), d.get_rank(given),
               d.all_reduce(x, group=unsorted), x, d.all_reduce(x, group=singles[r]), x,
               [(d.get_rank(g), d.get_world_size(g)) for g in singles]]
    if r in (0, p - 1):
        y = T(np.full(1, float(r)))
        answers += [d.get_process_group_ranks(unsorted), d.get_process_group_ranks(given),
                    d.get_global_rank(given, 0), d.get_group_rank(given, 0), d.broadcast(y, group_src=0, group=given),
                    y, d.send(y, group_dst=1, group=given) if r == p - 1 else d.recv(y, group_src=0, group=given), y]
    return answers


compare("groups", groups)


def batches(d, T):
    """A ring each way in one batch (receives first), then one on a group of ranks 0 and p - 1 by group_peer."""
    left, right = T(np.zeros(2)), T(np.zeros(3, "int64"))
    ops = [d.P2POp(d.irecv, left, (r - 1) % p, tag=1), d.P2POp(d.irecv, right, group_peer=(r + 1) % p, tag=2),
           d.P2POp(d.isend, T(np.full(2, float(r))), (r + 1) % p, tag=1),
           d.P2POp(d.isend, T(np.full(3, r, "int64")), (r - 1) % p, tag=2)]
    answers = [[w.wait() for w in d.batch_isend_irecv(ops)], left, right, [(o.peer, o.group_peer, o.tag) for o in ops]]
    pair = d.new_group([p - 1, 0], sort_ranks=False)
    if r in (0, p - 1):
        got = T(np.zeros(1))
        ops = [d.P2POp(d.isend, T(np.full(1, float(r))), group_peer=1 - d.get_rank(pair), group=pair),
               d.P2POp(d.irecv, got, p - 1 - r, group=pair)]
        works = d.batch_isend_irecv(ops)
        answers += [[w.wait() for w in works], got, [(o.peer, o.group_peer) for o in ops]]
    return answers


def subgroups(d, T):
    answers = []
    for size in (1, p):
        mine, every = d.new_subgroups(size)
        x = T(np.full(1, float(r + 1)))
        answers += [d.all_reduce(x, group=mine), x, d.get_process_group_ranks(mine), len(every),
                    [q for q, g in enumerate(every) if g is not d.GroupMember.NON_GROUP_MEMBER]]
    mine, every = d.new_subgroups_by_enumeration([[p - 1, 0]])
    return answers + [mine is None, len(every)]


def refused(call):
    try:
        call()
    except Exception:
        return "refused"
    return "done"


def refusals(d, T):
    everyone = d.new_group(list(range(p)))          # not the world's group object: a batch may not mix them
    x = T(np.zeros(2))
    return [refused(lambda: d.batch_isend_irecv([])), refused(lambda: d.P2POp(d.send, x, (r + 1) % p)),
            refused(lambda: d.batch_isend_irecv([d.P2POp(d.isend, x, (r + 1) % p),
                                                 d.P2POp(d.irecv, x, (r - 1) % p, group=everyone)])),
            refused(lambda: d.batch_isend_irecv(d.P2POp(d.isend, x, (r + 1) % p))),
            refused(lambda: d.new_subgroups(2)), refused(lambda: d.new_subgroups(0)),
            refused(lambda: d.new_subgroups(p + 1))]


compare("batch_isend_irecv", batches)
compare("new_subgroups", subgroups)
compare("monitored_barrier", lambda d, T: d.monitored_barrier(timeout=datetime.timedelta(seconds=60)))
compare("refusals", refusals)
tdist.destroy_process_group()
mdist.destroy_process_group()

"""minitrain.distributed's torch.distributed calls against MPI's built-ins (mpi4py), at any p, awkward sizes.

Each check prints "ok NAME" on every rank; a wrong result raises (the test reads the ok lines)."""
import datetime
import sys
import warnings

import numpy as np
from mpi4py import MPI

import minitrain as mt
import minitrain.distributed as dist

returned = dist.init_process_group("gloo")
r, p, world = dist.get_rank(), dist.get_world_size(), MPI.COMM_WORLD
rng = np.random.default_rng(100 + r)
N = 7                                    # prime: no p divides it


def read_only(a):
    a.flags.writeable = False
    return a


def ok(name, condition=True):
    if not condition:
        raise AssertionError(f"rank {r}: {name}")
    print(f"ok {name}", flush=True)


def mpi_allreduce(x, op=MPI.SUM):
    out = np.empty_like(x)
    world.Allreduce(x, out, op=op)
    return out


ok("init as PyTorch's", returned is None and dist.get_backend() == "gloo")

# all_reduce in place, every op; on a minitrain Tensor and on a non-contiguous view too
for name, op, mpi_op in (("sum", dist.ReduceOp.SUM, MPI.SUM), ("max", dist.ReduceOp.MAX, MPI.MAX),
                         ("min", dist.ReduceOp.MIN, MPI.MIN), ("product", dist.ReduceOp.PRODUCT, MPI.PROD)):
    x = rng.standard_normal(N)
    want = mpi_allreduce(x, mpi_op)
    dist.all_reduce(x, op=op)
    ok(f"all_reduce {name}", np.allclose(x, want, rtol=1e-13, atol=0))
x = rng.standard_normal(N)
want = mpi_allreduce(x) / p
dist.all_reduce(x, op=dist.ReduceOp.AVG)
ok("all_reduce avg", np.allclose(x, want, rtol=1e-13))
ints = np.arange(N, dtype=np.int64) * (r + 1)
want = mpi_allreduce(ints)
dist.all_reduce(ints)
ok("all_reduce int64 exact", np.array_equal(ints, want))
t = mt.Tensor(rng.standard_normal((3, 5)))
view = rng.standard_normal((5, 3)).T                 # not contiguous
want_t, want_v = mpi_allreduce(t.data.copy()), mpi_allreduce(np.ascontiguousarray(view))
dist.all_reduce(t)
dist.all_reduce(view)
ok("all_reduce Tensor and transposed view", np.allclose(t.data, want_t, rtol=1e-13)
   and np.allclose(view, want_v, rtol=1e-13))
x = rng.standard_normal(N)
want = mpi_allreduce(x)
work = dist.all_reduce(x, async_op=True)
ok("all_reduce async_op", work.wait(timeout=datetime.timedelta(seconds=60)) is True and work.is_completed()
   and np.allclose(x, want, rtol=1e-13))

# broadcast, reduce: src / dst are global ranks
x = rng.standard_normal(N)
want = world.bcast(x, root=p - 1)
dist.broadcast(x, src=p - 1)
ok("broadcast", np.array_equal(x, want))
# a read-only tensor: the source's is only read; any other rank's is refused before anything moves (the source
# does not call: nothing is sent)
if r != 0:
    try:
        dist.broadcast(read_only(np.empty(2)), src=0)
    except ValueError as e:
        refused = str(e)
y = read_only(np.full(2, 7.0)) if r == 0 else np.zeros(2)
dist.broadcast(y, src=0)
ok("broadcast read-only", np.array_equal(y, [7.0, 7.0]) and (r == 0 or refused == (
    f"[rank {r}] broadcast: tensor is read-only, and the call writes its result into it")))
x = rng.standard_normal(N)
want = np.empty_like(x) if r == 0 else None
world.Reduce(x, want, op=MPI.SUM, root=0)
mine = x.copy()
dist.reduce(x, dst=0)
ok("reduce", np.allclose(x, want, rtol=1e-13) if r == 0 else np.array_equal(x, mine))

# all_gather(_into_tensor), reduce_scatter(_tensor)
x = rng.standard_normal((2, 3))
want = np.concatenate(world.allgather(x))
out = np.empty((2 * p, 3))
dist.all_gather_into_tensor(out, x)
ok("all_gather_into_tensor", np.array_equal(out, want))
outs = [np.empty((2, 3)) for _ in range(p)]
dist.all_gather(outs, x)
ok("all_gather", np.array_equal(np.concatenate(outs), want))
x = rng.standard_normal(p * N)
want = mpi_allreduce(x)[r * N:(r + 1) * N]
out = np.empty(N)
dist.reduce_scatter_tensor(out, x)
ok("reduce_scatter_tensor", np.allclose(out, want, rtol=1e-13))
out = np.empty(N)
dist.reduce_scatter(out, [x[i * N:(i + 1) * N] for i in range(p)])
ok("reduce_scatter", np.allclose(out, want, rtol=1e-13))

# all_to_all_single with uneven splits, some empty (rank i sends (i + j) % 3 rows to rank j), all_to_all
sends = [(r + j) % 3 for j in range(p)]
receives = [(j + r) % 3 for j in range(p)]
x = rng.standard_normal((sum(sends), 2))
want = np.empty((sum(receives), 2))
world.Alltoallv([x, (np.array(sends) * 2, None), MPI.DOUBLE], [want, (np.array(receives) * 2, None), MPI.DOUBLE])
out = np.empty_like(want)
dist.all_to_all_single(out, x, output_split_sizes=receives, input_split_sizes=sends)
ok("all_to_all_single uneven", np.array_equal(out, want))
ins = [np.full(j + 1, 10.0 * r + j) for j in range(p)]        # rank r's j-th tensor: j + 1 elements
outs = [np.empty(r + 1) for _ in range(p)]
dist.all_to_all(outs, ins)
ok("all_to_all", all(np.array_equal(outs[j], np.full(r + 1, 10.0 * j + r)) for j in range(p)))

# in place as FSDP calls them (the input a slice of the output, the output a slice of the input), a strided
# output, 0-d and empty tensors: as PyTorch's under NCCL (gloo's answers to the first two can be wrong)
x = rng.standard_normal(3)
want = np.concatenate(world.allgather(x))
out = np.empty(3 * p)
out[3 * r:3 * r + 3] = x
dist.all_gather_into_tensor(out, out[3 * r:3 * r + 3])
stacked = np.empty((p, 3))
dist.all_gather_into_tensor(stacked, x)
x = rng.standard_normal(3 * p)
want_rs = x.copy()
want_rs[3 * r:3 * r + 3] = mpi_allreduce(x)[3 * r:3 * r + 3]      # the other blocks stay as they were
dist.reduce_scatter_tensor(x[3 * r:3 * r + 3], x)
ok("in place", np.array_equal(out, want) and np.array_equal(stacked.reshape(-1), want)
   and np.allclose(x, want_rs, rtol=1e-13))
x = (np.arange(2.0 * p) + 10 * r).reshape(p, 2)
strided = np.zeros((2, p)).T                           # a transposed view: row j from rank j
dist.all_to_all_single(strided, x)
zero_d, empty = np.array(float(r + 1)), np.empty((0, 2))
dist.all_reduce(zero_d)
dist.all_reduce(empty)
ok("strided, 0-d, empty", np.array_equal(strided.ravel(), [10.0 * j + 2 * r + k for j in range(p) for k in range(2)])
   and zero_d == p * (p + 1) / 2 and empty.shape == (0, 2))

# gather, scatter
x = np.full(3, float(r))
gathered = [np.empty(3) for _ in range(p)] if r == p - 1 else None
dist.gather(x, gathered, dst=p - 1)
ok("gather", r != p - 1 or all(np.array_equal(g, np.full(3, float(i))) for i, g in enumerate(gathered)))
out = np.empty(3)
dist.scatter(out, [np.full(3, 7.0 * i) for i in range(p)] if r == 0 else None, src=0)
ok("scatter", np.array_equal(out, np.full(3, 7.0 * r)))

# the object collectives: pickled objects of different sizes on every rank
objects = [None] * p
dist.all_gather_object(objects, {"rank": r, "words": ["w"] * (3 * r + 1)})
gathered_objects = [None] * p if r == p - 1 else None
dist.gather_object(("from", r), gathered_objects, dst=p - 1)
listed = [{"lr": 0.1}, "text", 7] if r == 1 % p else [None, None, None]
dist.broadcast_object_list(listed, src=1 % p)
ok("object collectives", objects == [{"rank": q, "words": ["w"] * (3 * q + 1)} for q in range(p)]
   and (r != p - 1 or gathered_objects == [("from", q) for q in range(p)]) and listed == [{"lr": 0.1}, "text", 7])

# send / recv / isend / irecv round the ring, a tag each way (p > 1: PyTorch refuses a send to oneself)
if p > 1:
    right, left = (r + 1) % p, (r - 1) % p
    x, got = np.full(N, float(r)), np.empty(N)
    request = dist.irecv(got, src=left, tag=3)
    dist.send(x, dst=right, tag=3)
    request.wait()
    ok("isend/irecv", np.array_equal(got, np.full(N, float(left))))
    if r == 0:
        dist.isend(x, dst=p - 1, tag=4).wait()
    if r == p - 1:
        ok("recv returns the sender", dist.recv(got, src=0, tag=4) == 0 and np.array_equal(got, np.zeros(N)))
work = dist.barrier(async_op=True)
ok("barrier async_op", work.wait() is True and work.is_completed())

# batch_isend_irecv: a ring each way in one batch, the receives first (any order works: all are posted before
# any wait), and a message to oneself; every Work's wait() is True
right, left = (r + 1) % p, (r - 1) % p
got_left, got_right, got_self = np.empty(N), np.empty(2, np.int64), np.empty(3)
works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got_left, left, tag=1),
                                dist.P2POp(dist.irecv, got_right, group_peer=right, tag=2),
                                dist.P2POp(dist.isend, np.full(N, float(r)), right, tag=1),
                                dist.P2POp(dist.isend, np.full(2, r, np.int64), left, tag=2),
                                dist.P2POp(dist.isend, np.arange(3.0) + r, r, tag=3),
                                dist.P2POp(dist.irecv, got_self, r, tag=3)])
ok("batch_isend_irecv ring", len(works) == 6 and all(w.wait() is True and w.is_completed() for w in works)
   and np.array_equal(got_left, np.full(N, float(left))) and np.array_equal(got_right, [right, right])
   and np.array_equal(got_self, np.arange(3.0) + r))

# new_subgroups: groups of 1 (this rank's, the others NON_GROUP_MEMBER here), and of the ranks on this node
mine, subgroups = dist.new_subgroups(group_size=1)
node, per_node = dist.new_subgroups()             # mpiexec on one machine: the whole world
x = np.full(2, float(r + 1))
dist.all_reduce(x, group=node)
ok("new_subgroups", dist.get_process_group_ranks(mine) == [r] and len(subgroups) == p and subgroups[r] is mine
   and all(g is dist.GroupMember.NON_GROUP_MEMBER for q, g in enumerate(subgroups) if q != r)
   and len(per_node) == 1 and per_node[0] is node and np.array_equal(x, np.full(2, p * (p + 1) / 2)))

# monitored_barrier: passes when all arrive; a rank that arrives after rank 0 has stopped waiting is named on
# rank 0 (the first one; all with wait_all_ranks=True), and every rank raises. The late ranks wait for rank 0's
# word that it has raised (no sleep to tune), then arrive; only the first case has a rank on time (rank 2).
ok("monitored_barrier", dist.monitored_barrier(timeout=datetime.timedelta(seconds=60)) is None)
for case, (late, wait_all, seconds) in enumerate((([1], True, 1.0), (list(range(1, p)), False, 0.3),
                                                  (list(range(1, p)), True, 0.3))):
    if r in late:
        dist.recv(np.empty(1), src=0, tag=9)
    try:
        dist.monitored_barrier(timeout=seconds, wait_all_ranks=wait_all)
    except RuntimeError as e:
        print(f"monitored_barrier case {case}: {e}", flush=True)
    if r == 0:
        for q in late:
            dist.send(np.ones(1), dst=q, tag=9)
dist.barrier()

# a group of the even ranks: its ranks sorted, global src, a rank outside returns at once
evens = dist.new_group([q for q in range(p) if q % 2 == 0][::-1])
alone, singles = dist.new_subgroups(1, group=evens)       # every rank calls it, one outside evens too
ok("new_subgroups of a group", len(singles) == len(range(0, p, 2))
   and (alone is None if r % 2 else dist.get_process_group_ranks(alone) == [r]))
x = np.full(N, float(r + 1))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.all_reduce(x, group=evens)
if r % 2 == 0:
    ok("group all_reduce", np.array_equal(x, np.full(N, float(sum(q + 1 for q in range(0, p, 2))))))
    ok("group ranks", dist.get_process_group_ranks(evens) == list(range(0, p, 2))
       and dist.get_rank(evens) == r // 2 and dist.get_world_size(evens) == len(range(0, p, 2)))
    y = np.full(2, float(r))
    dist.broadcast(y, src=2 if p > 2 else 0, group=evens)
    ok("group broadcast from a global rank", np.array_equal(y, np.full(2, 2.0 if p > 2 else 0.0)))
else:
    ok("outside the group", np.array_equal(x, np.full(N, float(r + 1))) and dist.get_rank(evens) == -1
       and any("does not belong to the given group" in str(w.message) for w in caught))
    try:
        dist.get_process_group_ranks(evens)
    except ValueError as e:
        print(f"refused a non-member's question: {e}", flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(2), 0, group=evens)])
    ok("outside the group batch_isend_irecv", works == [] and any("does not belong" in str(w.message) for w in caught))

# sort_ranks=False: the group's ranks in the order given (group rank 0 is global rank p - 1)
pair = dist.new_group([p - 1, 0], sort_ranks=False, group_desc="pair")
if r in (0, p - 1):
    y = np.full(2, float(r))
    dist.broadcast(y, group_src=0, group=pair)
    ok("sort_ranks=False", dist.get_rank(pair) == (r != p - 1) and dist.get_global_rank(pair, 0) == p - 1
       and np.array_equal(y, np.full(2, p - 1.0)))

# refusals, each one line
alone = [dist.new_group([i]) for i in range(p)][r]           # a group of this rank alone
for name, call in (("twice", lambda: dist.init_process_group("gloo")),
                   ("bad op", lambda: dist.all_reduce(np.ones(2), op="median")),
                   ("bitwise op", lambda: dist.all_reduce(np.ones(2, np.int64), op=dist.ReduceOp.BAND)),
                   ("integer mean", lambda: dist.all_reduce(np.ones(2, np.int64), op=dist.ReduceOp.AVG)),
                   ("group rank outside", lambda: dist.get_global_rank(dist.group.WORLD, p)),
                   ("output too long", lambda: dist.all_to_all_single(np.empty(p + 1), np.ones(p))),
                   ("ranks not integers", lambda: dist.new_group([0, 1.5])),
                   ("src outside", lambda: dist.broadcast(np.ones(2), src=p)),
                   ("wrong output size", lambda: dist.all_gather_into_tensor(np.empty(p * 2 + 1), np.ones(2))),
                   ("any source", lambda: dist.recv(np.ones(2))),
                   ("to itself", lambda: dist.send(np.ones(2), dst=r)),
                   ("a list", lambda: dist.all_reduce([1.0, 2.0])),
                   ("empty batch", lambda: dist.batch_isend_irecv([])),
                   ("not a P2POp", lambda: dist.batch_isend_irecv([dist.isend])),
                   ("op not isend or irecv", lambda: dist.P2POp(dist.send, np.ones(2), (r + 1) % p)),
                   ("mixed groups", lambda: dist.batch_isend_irecv([
                       dist.P2POp(dist.isend, np.ones(2), (r + 1) % p),
                       dist.P2POp(dist.irecv, np.ones(2), r, group=mine)])),
                   ("to itself unpaired", lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(2), r)])),
                   ("peer outside", lambda: dist.P2POp(dist.irecv, np.ones(2), p)),
                   ("subgroups uneven", lambda: dist.new_subgroups(p - 1)),       # (p > 2: p - 1 divides no p)
                   ("subgroups disagree", lambda: dist.new_subgroups(1 if r == 0 else p)),
                   ("monitored timeout", lambda: dist.monitored_barrier(timeout=-1)),
                   ("read-only tensor", lambda: dist.all_reduce(read_only(np.ones(2)))),
                   ("read-only output", lambda: dist.all_gather_into_tensor(read_only(np.empty(2 * p)), np.ones(2))),
                   ("read-only list", lambda: dist.all_gather([np.empty(2)] + [read_only(np.empty(2))] * (p - 1),
                                                              np.ones(2))),
                   ("read-only gather list", lambda: dist.gather(np.ones(2), [read_only(np.empty(2))], group_dst=0,
                                                                 group=alone)),   # (only the destination's list)
                   ("read-only scatter", lambda: dist.scatter(read_only(np.empty(2)), [np.ones(2)] * p if r == 0
                                                              else None, src=0)),
                   ("read-only receive", lambda: dist.irecv(read_only(np.empty(2)), (r + 1) % p)),
                   ("read-only receive in a batch", lambda: dist.batch_isend_irecv([    # (nothing posted)
                       dist.P2POp(dist.isend, np.ones(2), (r + 1) % p),
                       dist.P2POp(dist.irecv, read_only(np.empty(2)), (r - 1) % p)]))):
    try:
        call()
    except (ValueError, TypeError) as e:
        print(f"refused {name}: {e}", flush=True)
    else:
        raise AssertionError(f"rank {r}: {name} was not refused")
dist.barrier()
dist.destroy_process_group()
ok("destroyed", not dist.is_initialized())
sys.exit(0)

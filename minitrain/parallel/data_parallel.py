"""Data parallelism: DistributedDataParallel (Li et al. 2020, "PyTorch Distributed", sec. 3-4).

Every rank holds the whole model and runs forward and backward on its share of the global batch;
then the gradients are averaged, so every replica takes the same step (Goyal et al. 2017).
What makes it fast is *when* the averaging happens:

* gradients are packed into buckets in reverse parameter order (roughly the order backward
  finishes them), each at most bucket_cap_mb;
* a parameter's post-accumulate-grad hook copies its gradient into its bucket; when the last
  gradient of a bucket arrives, the bucket's all-reduce starts asynchronously, while backward
  carries on with earlier layers (communication overlaps computation);
* a callback at the end of backward launches any bucket still open (parameters that got no
  gradient contribute zeros), waits for every reduction and writes the averages back into
  .grad: when loss.backward() returns, gradients are synchronised, as in PyTorch.

Bytes sent per rank per step: 2(p-1)/p·Ψ·itemsize (ring all-reduce of every bucket). Memory: one
flat buffer per bucket for the gradients and one for the result (comm_buffers).
"""
import contextlib
import hashlib
import math

import numpy as np

from .. import backend
from ..autograd.engine import queue_callback
from ..backend import array_module
from ..comm import all_reduce, all_reduce_coalesced, broadcast, ring_all_gather
from ..comm.collectives import check_algorithm
from . import accounting


class _Bucket:
    def __init__(self, index, params, xp):
        self.index = index
        self.params = params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append((n, n + p.size))
            n += p.size
        self.size = n
        self.dtype = params[0].dtype
        self.flat = xp.zeros(n, self.dtype)       # gradients copied in by the hooks
        self.reduced = xp.empty(n, self.dtype)    # the averaged result
        self.ready = set()
        self.work = None


def check_reduce_op(reduce_op, who):
    """The gradients' reduction over the replicas: "mean", or "sum" where each replica's backward was seeded
    with 1/replicas already (16-bit gradients: no partial sum exceeds the global one, as PyTorch DDP divides
    before it sums)."""
    if reduce_op not in ("mean", "sum"):
        raise ValueError(f"{who}: reduce_op must be 'mean' or 'sum', got {reduce_op!r}")
    return reduce_op


def bucket_cap_bytes(bucket_cap_mb, who):
    """The bucket cap in bytes: a finite number of MiB, 0 or more (0: a bucket per parameter, as PyTorch's 0 makes;
    NaN ended in int()'s error, a negative cap was taken)."""
    if not (backend.is_real(bucket_cap_mb) and 0 <= bucket_cap_mb < math.inf):
        raise ValueError(f"{who}: bucket_cap_mb must be a finite number of MiB, 0 or more, got {bucket_cap_mb!r}")
    return int(bucket_cap_mb * 1024 * 1024)


@accounting.ddp                  # its buffers in the memory ledger, trace spans, bytes sent: see accounting.py
class DistributedDataParallel:
    """Wrap ``module`` for data-parallel training over ``comm`` (PyTorch's name and call shape).

    ``bucket_cap_mb``: bucket size cap in MiB (PyTorch's default is 25). ``broadcast_from``: the
    rank whose initial parameters every replica copies at wrap time. Frozen parameters
    (``requires_grad=False``) are left out of the buckets; a parameter that gets no gradient in
    a backward contributes the gradient it holds (accumulated under ``no_sync``) or zeros (so no rank
    ever waits for a bucket that cannot complete; buckets reduce in one order on every rank), and with
    ``find_unused_parameters=True`` a parameter that no rank used keeps ``grad = None``, exactly
    as in single-process training. A Parameter shared by two modules (tied weights) appears
    once in ``parameters()``, so it is reduced once, with the sum of both uses. ``algorithm``: the
    all-reduce of each bucket, ``ring`` (bandwidth-optimal, the default), ``recursive_doubling``,
    ``naive`` or ``auto`` (by size). ``reduce_op="sum"`` where backward's seed divides by the replicas (16-bit
    gradients). Gradients add up over backward calls until ``zero_grad``, unreduced in ``no_sync()``.
    """

    def __init__(self, module, comm, bucket_cap_mb=25.0, broadcast_from=0, find_unused_parameters=False,
                 algorithm="ring", reduce_op="mean"):
        self.module, self.comm = module, comm
        self.reduce_op = check_reduce_op(reduce_op, "DistributedDataParallel")
        self.find_unused_parameters = find_unused_parameters
        self.algorithm = check_algorithm(algorithm, "DistributedDataParallel")
        self.bucket_cap_bytes = bucket_cap_bytes(bucket_cap_mb, "DistributedDataParallel")
        self._sync, self._pending = True, False
        self._broadcast_parameters(broadcast_from)
        self.buckets = self._build_buckets()
        self._bucket_of = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._bucket_of[id(p)] = (bucket, i)
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _broadcast_parameters(self, root):
        """Every replica starts from rank ``root``'s parameters."""
        for p in self.module.parameters():
            broadcast(self.comm, p.data, root=root)

    # ---- buckets
    def _build_buckets(self):
        """Reverse parameter order, split at the cap and wherever the dtype changes."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DistributedDataParallel: the module has no parameter that requires grad")
        xp = array_module(params[0].data)
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and (size + p.data.nbytes > self.bucket_cap_bytes or p.dtype != current[0].dtype):
                buckets.append(_Bucket(len(buckets), current, xp))
                current, size = [], 0
            current.append(p)
            size += p.data.nbytes
        buckets.append(_Bucket(len(buckets), current, xp))
        return buckets

    # ---- the forward pass is the module's own
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict)

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block; the first backward
        outside it reduces the accumulated sum: one all-reduce per optimizer step."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ---- hooks
    def _grad_ready(self, param):
        if not self._sync:
            return
        if not self._pending:                       # first gradient of this backward
            self._pending = True
            self._next_bucket = 0
            queue_callback(self._finish)
        bucket, i = self._bucket_of[id(param)]
        start, end = bucket.offsets[i]
        bucket.flat[start:end] = param.grad.reshape(-1)
        bucket.ready.add(i)
        # complete buckets launch in bucket order, never past an incomplete one: every rank issues the
        # same all-reduces in one order, even where ranks used different parameters (PyTorch's rule)
        while self._next_bucket < len(self.buckets) and len(self.buckets[self._next_bucket].ready) == \
                len(self.buckets[self._next_bucket].params):
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket):
        if self.find_unused_parameters:
            # used: a gradient this backward, or one accumulated since zero_grad (under no_sync)
            used = np.array([float(i in bucket.ready or q.grad is not None) for i, q in enumerate(bucket.params)])
            bucket.used_work = all_reduce(self.comm, used, op="sum", async_op=True)
        bucket.work = all_reduce(self.comm, bucket.flat, op=self.reduce_op, algorithm=self.algorithm,
                                 out=bucket.reduced, async_op=True)

    def _finish(self):
        """End of backward: launch open buckets, wait, write back. A parameter this backward did not
        reach contributes the gradient it holds (accumulated under no_sync), or zeros (PyTorch's rule)."""
        for bucket in self.buckets[self._next_bucket:]:
            for i, q in enumerate(bucket.params):
                if i not in bucket.ready:
                    start, end = bucket.offsets[i]
                    bucket.flat[start:end] = 0 if q.grad is None else q.grad.reshape(-1)
            self._launch(bucket)
        self._wait_for_buckets()
        self._pending = False

    def _wait_for_buckets(self):
        """Wait for every bucket's all-reduce and write the averages back into .grad."""
        for bucket in self.buckets:
            bucket.work.wait()
            used = bucket.used_work.wait() if self.find_unused_parameters else None
            for i, p in enumerate(bucket.params):
                start, end = bucket.offsets[i]
                if used is not None and used[i] == 0:
                    p.grad = None                    # no rank used it: as in one process
                    continue
                averaged = bucket.reduced[start:end].reshape(p.shape)
                if p.grad is None:
                    p.grad = averaged.copy()
                else:
                    p.grad[...] = averaged
            bucket.work = None
            bucket.ready.clear()


def parameters_digest(module):
    """A 64-bit digest of every parameter's bytes, in named_parameters order."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(np.ascontiguousarray(p.numpy()).tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def check_replicas_equal(module, comm):
    """Raise if any rank's parameters differ from rank 0's, naming the ranks that diverged."""
    digests = ring_all_gather(comm, np.array([parameters_digest(module)], np.int64), total=comm.size)
    diverged = [r for r in range(comm.size) if digests[r] != digests[0]]
    if diverged:
        raise RuntimeError(f"[rank {comm.rank}] replicas diverged: rank(s) {diverged} hold parameters that "
                           f"differ from rank 0's (digests {digests.tolist()})")
    return True


@accounting.local_sgd             # its averaging is a trace span: see accounting.py
class LocalSGD:
    """Periodic parameter averaging (local SGD; Lin et al. 2020, "Don't use large mini-batches,
    use local SGD"): each rank steps on its own gradients, and every ``sync_every`` optimizer steps
    the parameters are averaged across ranks. One all-reduce of Ψ parameters per ``sync_every``
    steps instead of one of Ψ gradients per step: less communication, staler replicas.
    Call ``step()`` after each ``optimizer.step()``; it returns True when it averaged. With an
    optimizer that keeps fp32 master weights (MixedPrecisionOptimizer, CPUOffloadOptimizer), pass it
    as ``optimizer=``: the masters are what is averaged (averaging the fp16 copies alone would be
    undone by the next step). ``algorithm``: ring, recursive_doubling, naive or auto. With plain
    or momentum SGD and ``sync_every=1`` this equals one process on the global batch exactly (the
    update is linear in the gradient)."""

    def __init__(self, module, comm, sync_every=4, broadcast_from=0, algorithm="ring", optimizer=None):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.module, self.comm, self.sync_every = module, comm, sync_every
        self.algorithm = check_algorithm(algorithm, "LocalSGD")
        self.optimizer = optimizer
        self.steps = 0
        for p in module.parameters():
            broadcast(comm, p.data, root=broadcast_from)
        for q, master in self._masters():              # masters made before the broadcast: refresh
            master.data[...] = backend.to_host(q.data) if getattr(self.optimizer, "offload", False) else q.data

    def _masters(self):
        opt = self.optimizer
        return list(zip(opt.params, opt.masters)) if opt is not None and hasattr(opt, "masters") else []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def step(self):
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.synchronize()
        return True

    def synchronize(self):
        """Average the parameters (or the optimizer's masters) across ranks now (also at the end of
        training, so that the replicas agree whatever the last step was)."""
        pairs = self._masters()
        arrays = [m.data for _, m in pairs] if pairs else [p.data for p in self.module.parameters()]
        all_reduce_coalesced(self.comm, arrays, op="mean", algorithm=self.algorithm)
        for q, master in pairs:                       # the parameters: the averaged masters, rounded
            q.data[...] = backend.to_device(master.data) if backend.is_device_array(q.data) else master.data

    def state_dict(self):
        """The averaging phase (steps since the start): a checkpoint taken right after an averaging
        holds equal replicas; the optimizers' states still differ per rank (each steps on its own)."""
        return {"steps": self.steps, "sync_every": self.sync_every}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])

"""DataParallel: the single-process, multi-threaded design that DDP replaced (Li et al. 2020, sec. 2).

Every step: scatter the batch into one chunk per replica, replicate the module (copy
every parameter to every replica), run the replicas' forwards in threads, gather the outputs
onto replica 0, and in backward reduce every replica's gradients onto replica 0's parameters.
That is 2(n-1)·Ψ parameter/gradient bytes through one place per step, plus the activations, and
one Python process whose GIL serialises whatever does not release it. DDP instead keeps a
replica per process for good and moves only 2(n-1)/n·Ψ per rank. stats counts each exchange.

Here the replicas share one machine, so "copying to a device" is copying an array; the engine's
ordinary accumulation of gradients into a leaf *is* the reduce onto replica 0.
"""
import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import backend, memory
from ..autograd import Function, Tensor, cat


class _Replicate(Function):
    """Forward: copy a parameter to a replica. Backward: send the replica's gradient back to
    replica 0 (where the engine adds it into the parameter's .grad)."""

    @staticmethod
    def forward(ctx, a, stats):
        ctx.stats = stats
        stats["replicate_bytes"] += a.nbytes
        return a.copy()

    @staticmethod
    def backward(ctx, grad):
        ctx.stats["reduce_bytes"] += grad.nbytes
        return grad, None


class DataParallel:
    def __init__(self, module, num_replicas):
        if num_replicas < 1:
            raise ValueError(f"DataParallel needs at least one replica, got {num_replicas}")
        self.module, self.num_replicas = module, num_replicas
        # replica 0 is the module itself; the others are copies whose parameters are overwritten,
        # every step, by copies of the module's parameters
        self.replicas = [module] + [copy.deepcopy(module) for _ in range(num_replicas - 1)]
        self._slots = [None] + [self._slots_of(replica) for replica in self.replicas[1:]]
        self.trackers = [memory.tracker()] + [memory.MemoryTracker() for _ in range(num_replicas - 1)]
        self.stats = self._zero_stats()
        self._pool = ThreadPoolExecutor(max_workers=num_replicas)

    @staticmethod
    def _zero_stats():
        return {"scatter_bytes": 0, "replicate_bytes": 0, "gather_bytes": 0, "reduce_bytes": 0}

    def _slots_of(self, replica):
        """(module, attribute, original parameter) for every parameter slot of a replica. deepcopy
        keeps sharing, so replica and original list their parameters in the same order, and a tied
        parameter fills two slots with one original."""
        original = {id(rp): op for (_, rp), (_, op) in zip(replica.named_parameters(), self.module.named_parameters())}
        return [(mod, attr, original[id(rp)]) for _, mod in replica.named_modules()
                for attr, rp in mod._parameters.items() if rp is not None]

    def _replicate(self, i):
        """Point replica i's parameter attributes at fresh copies of replica 0's parameters."""
        copies = {}
        for mod, attr, source in self._slots[i]:
            if id(source) not in copies:
                copies[id(source)] = _Replicate.apply(source, self.stats) if source.requires_grad else source
            object.__setattr__(mod, attr, copies[id(source)])   # the attribute forward() reads

    def __call__(self, x, *args):
        data = x.data if isinstance(x, Tensor) else x
        if len(data) < self.num_replicas:
            raise ValueError(f"a batch of {len(data)} cannot be split over {self.num_replicas} replicas")
        bounds = [len(c) for c in np.array_split(np.arange(len(data)), self.num_replicas)]
        starts = np.cumsum([0] + bounds).tolist()
        chunks = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]    # contiguous rows: views, no index arrays
        self.stats["scatter_bytes"] += sum(data[c].nbytes for c in chunks[1:])

        def run(i):
            backend.bind_thread()                    # a pool thread computes on this process's GPU
            with memory.use_tracker(self.trackers[i]):
                if i > 0:
                    self._replicate(i)
                return self.replicas[i](Tensor(data[chunks[i]]), *args)
        outputs = list(self._pool.map(run, range(self.num_replicas)))
        self.stats["gather_bytes"] += sum(o.data.nbytes for o in outputs[1:])
        return cat(outputs, axis=0)

    def parameters(self):
        return self.module.parameters()

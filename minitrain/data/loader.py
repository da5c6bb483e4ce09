"""A minimal batch loader over in-memory arrays: yields (x, y) batches in the order of a sampler
(DistributedSampler, or a seeded shuffle of everything). state_dict() is its position (epoch,
batches yielded in it), so a resumed job continues mid-epoch (as torchdata's StatefulDataLoader).

global_batch=True (the jobs'): batch_size is the global batch (all ranks together) and each batch
yielded is this rank's share of it (DistributedSampler.global_batches: no sample repeated or
dropped, the last batch of an epoch partial, a share possibly empty); global_rows is then the
size of the global batch just yielded, for the loss weighting (sampler.share_weight). drop_last then
drops the last global batch if partial; the sampler's own drop_last and padding (PyTorch's, for
indices()) do not apply."""
import numpy as np

from .. import backend
from .sampler import DistributedSampler


class DataLoader:
    def __init__(self, arrays, batch_size, shuffle=True, seed=0, sampler=None, drop_last=False, global_batch=False):
        self.arrays = tuple(arrays)
        n = len(self.arrays[0])
        if any(len(a) != n for a in self.arrays):
            raise ValueError("all arrays given to DataLoader must have the same length")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.drop_last, self.global_batch = batch_size, drop_last, global_batch
        self.sampler = sampler or DistributedSampler(n, num_replicas=1, rank=0, seed=seed, shuffle=shuffle)
        self.batches_done = 0           # batches yielded in the current epoch
        self.global_rows = None         # global_batch: the rows of the global batch last yielded
        self._resume_at = 0

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def __len__(self):
        m = self.sampler.n if self.global_batch else len(self.sampler)
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    def __iter__(self):
        skip, self._resume_at = self._resume_at, 0
        self.batches_done = skip
        if self.global_batch:
            for mine, rows in self.sampler.global_batches(self.batch_size, self.drop_last, start=skip):
                self.batches_done += 1
                self.global_rows = rows
                yield tuple(backend.to_device(a[mine]) for a in self.arrays)
            return
        idx = np.asarray(self.sampler.indices())
        for start in range(skip * self.batch_size, len(idx), self.batch_size):
            batch = idx[start:start + self.batch_size]
            if self.drop_last and len(batch) < self.batch_size:
                return
            self.batches_done += 1
            yield tuple(backend.to_device(a[batch]) for a in self.arrays)

    def _global_batch_size(self):
        return self.batch_size if self.global_batch else self.batch_size * self.sampler.world

    def state_dict(self):
        """Where the data stands: the epoch and the batches already yielded in it. With the global
        batch unchanged, batch j holds the same samples on any number of ranks (DistributedSampler;
        with padding, all but the last of an epoch), so the position carries over to another world size."""
        return {"epoch": self.sampler.epoch, "batches_done": self.batches_done, "seed": self.sampler.seed,
                "global_batch_size": self._global_batch_size()}

    def load_state_dict(self, state):
        """The next iteration starts at batch ``batches_done`` of epoch ``epoch``."""
        global_batch = self._global_batch_size()
        if state["global_batch_size"] != global_batch or state["seed"] != self.sampler.seed:
            raise ValueError(f"the data position was saved for a global batch of {state['global_batch_size']} "
                             f"(seed {state['seed']}); this loader's is {global_batch} (seed {self.sampler.seed})")
        self.sampler.set_epoch(int(state["epoch"]))
        self.batches_done = self._resume_at = int(state["batches_done"])

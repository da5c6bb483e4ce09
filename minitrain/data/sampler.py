"""DistributedSampler: each rank a disjoint share of one global permutation.

Per epoch, one permutation of range(n) is drawn from (seed, epoch), the same on every rank.

Two ways to share it out. PyTorch's (indices(), iteration, len()): rank r takes every world-th
index starting at r; if n is not divisible by world, the permutation is padded by repeating its
start (or cut, with drop_last), so a batch of b per rank holds, across ranks, the b·world indices
one process would see, except in the last batch, which holds repeated (or misses cut) samples.
The jobs' (global_batches(), with DataLoader(..., global_batch=True)): the unpadded permutation
is cut into global batches of B, the last one possibly partial, and rank r takes every world-th
index of each starting at r (split_sizes(b, world) rows: uneven when world does not divide b, none
when b < world). Nothing repeated or dropped, and global batch j holds the same samples on any
number of ranks; weighting each rank's loss by its rows over the global rows (share_weight) makes
the ranks' mean the one-process loss. Where world divides B, rank r's rows in a full batch are the
same as with PyTorch's layout.
"""
import math

import numpy as np

from ..backend import is_int


def split_sizes(count, parts):
    """count rows into parts as evenly as possible (the first count % parts get one more; some may
    get none): the rows rank r takes with a stride of parts, or a contiguous split."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def share_weight(rows, global_rows, parts):
    """The factor on a share's mean loss over its ``rows`` so that the mean over the ``parts``
    shares (what DDP, ZeRO and the dp all-reduces compute) is the mean over the ``global_rows``:
    rows·parts/global_rows (1.0 when the shares are equal)."""
    if rows * parts == global_rows:
        return 1.0
    return rows * parts / global_rows


def share_loss(loss_fn, output, target, global_rows, parts):
    """loss_fn(output, target), a mean over this share's rows, times share_weight. A share with no
    rows gives a zero that still has a graph: its backward runs the same collectives as the others'."""
    rows = len(target)
    if rows == 0:
        return output.sum() * 0.0
    weight = share_weight(rows, global_rows, parts)
    loss = loss_fn(output, target)
    return loss if weight == 1.0 else loss * weight


class DistributedSampler:
    """torch.utils.data.distributed.DistributedSampler's call shape: ``dataset`` (anything with a length, or the
    number of samples), ``num_replicas`` and ``rank``. Both are given: data/ sits below the ranks' layers and does
    not read the process group (PyTorch takes them from it when left out)."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        n = dataset if is_int(dataset) else len(dataset)
        if num_replicas is None or rank is None:
            raise ValueError("DistributedSampler: give num_replicas and rank (e.g. dist.get_world_size(), "
                             "dist.get_rank()): minitrain's data layer does not read the process group")
        world = num_replicas
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"DistributedSampler: rank {rank} is not in a world of num_replicas={world}")
        if n < 0:
            raise ValueError(f"DistributedSampler: the number of samples must be >= 0, got {n}")
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = n // world
        else:
            self.num_samples = math.ceil(n / world)
        self.total_size = self.num_samples * world

    @property
    def num_replicas(self):
        """PyTorch's name for the world the sampler shares out over."""
        return self.world

    def set_epoch(self, epoch):
        """A new permutation each epoch, the same on every rank."""
        self.epoch = epoch

    def permutation(self):
        """This epoch's order of range(n), the same on every rank: what one process iterates."""
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return np.arange(self.n)

    def global_order(self):
        """The permutation padded or cut to total_size (PyTorch's layout)."""
        order = self.permutation()
        if self.total_size > self.n:
            reps = math.ceil(self.total_size / max(self.n, 1))
            order = np.tile(order, reps)
        return order[:self.total_size]

    def indices(self):
        return self.global_order()[self.rank::self.world]

    def global_batches(self, batch_size, drop_last=False, start=0):
        """(this rank's indices, the global batch's size) for each global batch of the unpadded
        permutation, from batch ``start`` on; drop_last: without the last partial batch."""
        order = self.permutation()
        for begin in range(start * batch_size, self.n, batch_size):
            batch = order[begin:begin + batch_size]
            if drop_last and len(batch) < batch_size:
                return
            yield batch[self.rank::self.world], len(batch)

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples

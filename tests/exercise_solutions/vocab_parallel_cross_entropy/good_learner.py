"""A learner's vocabulary-parallel cross-entropy."""
import numpy as np

from minitrain.comm import ring_all_reduce


def vocab_parallel_cross_entropy(comm, logits, targets, start):
    n, width = logits.shape
    m = ring_all_reduce(comm, np.ascontiguousarray(logits.max(axis=1)), op="max")
    e = np.exp(logits - m[:, None])
    total = ring_all_reduce(comm, e.sum(axis=1))
    mine = (targets >= start) & (targets < start + width)
    rows = np.arange(n)
    target_logit = np.where(mine, logits[rows, np.where(mine, targets - start, 0)], 0.0)
    target_logit = ring_all_reduce(comm, np.ascontiguousarray(target_logit))
    loss = float(np.mean(np.log(total) + m - target_logit))
    grad = e / total[:, None]
    grad[rows[mine], targets[mine] - start] -= 1.0
    return loss, grad / n

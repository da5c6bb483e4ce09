"""The ranks agree on whether to average with an all-reduce every step: one message per step, which is
what local SGD set out to save (every rank already knows step and sync_every)."""
import numpy as np

from minitrain.comm import all_reduce


def average_parameters(comm, params, step, sync_every):
    due = all_reduce(comm, np.array([float(step % sync_every == 0)]), op="max")[0]
    if not due:
        return False
    for q in params:
        q.data[...] = all_reduce(comm, q.data, op="mean")
    return True

EXPECT = ['after step 1, rank 0: sent 8 bytes in 1 message(s) on a step that does not average']

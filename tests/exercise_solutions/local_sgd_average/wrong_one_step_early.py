"""Averages when step + 1 is a multiple of sync_every: one optimizer step early every period."""
from minitrain.comm import all_reduce


def average_parameters(comm, params, step, sync_every):
    if (step + 1) % sync_every:
        return False
    for q in params:
        q.data[...] = all_reduce(comm, q.data, op="mean")
    return True

EXPECT = ['averaged after steps [3, 7], expected after [4, 8]: one step early']

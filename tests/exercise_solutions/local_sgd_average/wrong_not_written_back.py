"""The mean computed, and dropped: all_reduce returns a new array."""
from minitrain.comm import all_reduce


def average_parameters(comm, params, step, sync_every):
    if step % sync_every:
        return False
    for q in params:
        all_reduce(comm, q.data, op="mean")      # a new array, returned and dropped
    return True

EXPECT = ['returned True after steps [4, 8], but the parameters are unchanged']

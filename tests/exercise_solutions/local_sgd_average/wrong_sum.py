"""All-reduces with op='sum': every replica p times the mean."""
from minitrain.comm import all_reduce


def average_parameters(comm, params, step, sync_every):
    if step % sync_every:
        return False
    for q in params:
        q.data[...] = all_reduce(comm, q.data, op="sum")
    return True

EXPECT = ['rank 0: parameter 0', 'every element is 2 times the expected one', 'a mean was due']

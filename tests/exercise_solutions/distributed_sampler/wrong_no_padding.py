"""Deals the unpadded order out: when p does not divide n the first n % p ranks get one index
more, take one step more, and wait in an all-reduce the others never call."""


def shard(order, num_replicas, rank, drop_last=False):
    n = len(order)
    if drop_last:
        order = order[:n // num_replicas * num_replicas]
    return order[rank::num_replicas]


def global_batch_shard(order, batch_size, num_replicas, rank, start=0):
    for begin in range(start * batch_size, len(order), batch_size):
        batch = order[begin:begin + batch_size]
        yield batch[rank::num_replicas], len(batch)

EXPECT = ['lengths [4, 3, 3, 3]', 'DDP hangs', "these are the unpadded order's strides"]

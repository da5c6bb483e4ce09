"""Debugging exercise debug_zero_mismatch: ZeRO-1 that runs, but not like one process.

train(comm) fits a linear model of N = 22 weights with SGD and momentum, ZeRO-1 style: the weights
are padded to S·p (S = ceil(N/p)), rank r keeps the momentum of its shard only, gradients are
reduce-scattered (averaged), each rank updates its shard, and the shards are all-gathered back.
It should return (losses, weights): the loss of every step and the weights after every step,
equal to one process training on the whole batch. They are not, and nothing raises an error.

Run it and read what minitrain reports (where the weights differ from one process):

    python -m minitrain.exercises run debug_zero_mismatch
    python mine.py                       (the same, on your copy)

Then fix your copy and check it:

    python -m minitrain.exercises check debug_zero_mismatch mine.py
"""
import numpy as np

from minitrain import backend
from minitrain.comm import all_reduce, ring_all_gather, ring_reduce_scatter


def train(comm, steps=3, batch=12, n=22, lr=0.05, beta=0.9):
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(0)
    X = rng.standard_normal((steps, batch, n))
    Y = X @ rng.standard_normal(n)
    X, Y = backend.to_device(X), backend.to_device(Y)       # on the GPU with MINITRAIN_DEVICE=cuda
    xp = backend.array_module(X)                            # NumPy, or CuPy on the GPU
    shard = -(-n // p)                            # S: the padded buffer holds S·p elements
    first, last = r * shard, (r + 1) * shard - 1  # this rank's shard: elements first .. last
    w = xp.zeros(shard * p)                       # weights, padded; the same on every rank
    momentum = xp.zeros(shard)                    # this rank's shard of the optimizer state
    share = batch // p
    x_all, y_all = X[:, r * share:(r + 1) * share], Y[:, r * share:(r + 1) * share]
    losses, weights = [], []
    for step in range(steps):
        x, y = x_all[step], y_all[step]
        err = x @ w[:n] - y
        losses.append(float(all_reduce(comm, (err ** 2).mean().reshape(1), op="mean")[0]))
        grad = xp.zeros(shard * p)
        grad[:n] = 2 * x.T @ err / len(y)
        mine = ring_reduce_scatter(comm, grad, op="mean")     # the averaged gradient of my shard
        momentum = mine if step == 0 else beta * momentum + mine
        for i in range(first, last + 1):                      # update my shard (last included)
            w[i] -= lr * momentum[i - first]
        w = ring_all_gather(comm, w[first:last + 1].copy(), total=shard * p)
        weights.append(w[:n].copy())
    return losses, weights


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_zero_mismatch")

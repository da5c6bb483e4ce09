"""Makes the all-gather match the loop (first .. last - 1) instead of the other way round."""
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
        for i in range(first, last):                          # update my shard
            w[i] -= lr * momentum[i - first]
        w = ring_all_gather(comm, w[first:last].copy(), total=shard * p)
        weights.append(w[:n].copy())
    return losses, weights


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_zero_mismatch")

EXPECT = ['ring_all_gather', 'shard of']

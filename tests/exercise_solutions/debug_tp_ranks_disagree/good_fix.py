"""Debugging exercise debug_tp_ranks_disagree: a tensor-parallel MLP that trains the wrong model.

train(comm) trains Y = ReLU(H A) B, H = X E, with Megatron's tensor parallelism: every rank holds
the input layer E whole, rank r holds the columns A_r of A and the rows B_r of B, and f and g
(minitrain's CopyToTensorParallelRegion and ReduceFromTensorParallelRegion) carry the
communication. It should return (losses, E, A_r, B_r, all_reduces): the loss of every step, the
weights after training (E whole, A and B this rank's shards) and how many all-reduces ran, with
losses and weights equal to the unsplit model trained in one process. On one
rank it is. On two it is not, and nothing raises an error.

Run it and read what minitrain reports (each rank's losses beside one process's, the collectives):

    python -m minitrain.exercises run debug_tp_ranks_disagree
    python mine.py                       (the same, on your copy)

Then fix your copy and check it:

    python -m minitrain.exercises check debug_tp_ranks_disagree mine.py
"""
import numpy as np

import minitrain as mt
from minitrain.nn import functional as F
from minitrain.parallel.tensor_parallel import CopyToTensorParallelRegion as f
from minitrain.parallel.tensor_parallel import ReduceFromTensorParallelRegion as g


def train(comm, steps=3, lr=0.1, hidden=12):
    t, r = comm.size, comm.rank
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((8, 5)), rng.standard_normal((8, 3))
    E = mt.Tensor(rng.standard_normal((5, 5)) * 0.5, requires_grad=True)    # replicated
    A, B = rng.standard_normal((5, hidden)) * 0.5, rng.standard_normal((hidden, 3)) * 0.5
    n = hidden // t
    A_r = mt.Tensor(A[:, r * n:(r + 1) * n].copy(), requires_grad=True)     # column-parallel
    B_r = mt.Tensor(B[r * n:(r + 1) * n].copy(), requires_grad=True)        # row-parallel
    calls0 = comm.stats["ring_all_reduce"]["calls"]
    losses = []
    for step in range(steps):
        x = f.apply(mt.Tensor(X) @ E, comm)        # identity forward, all-reduce of dH backward
        h = (x @ A_r).relu()                       # this rank's hidden columns
        y = g.apply(h @ B_r, comm)                 # the row-parallel layer's output: sum the partial products
        loss = F.mse_loss(y, mt.Tensor(Y))
        E.grad = A_r.grad = B_r.grad = None
        loss.backward()
        losses.append(float(loss.data))
        for w in (E, A_r, B_r):
            w.data -= lr * w.grad
    all_reduces = comm.stats["ring_all_reduce"]["calls"] - calls0
    return losses, E.data, A_r.data, B_r.data, all_reduces


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_tp_ranks_disagree")

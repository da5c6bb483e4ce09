"""Debugging exercise debug_ddp_more_ranks: data parallelism that trains differently on more ranks.

train(comm) trains a small MLP data-parallel: every rank holds the model, runs forward and
backward on its share of each batch, and all-reduces the gradients before the SGD step. It
should return (losses, params): the loss of every step averaged over the ranks and the final
parameters (name -> array), equal to one process training on the whole batch: the point of data
parallelism. On one rank they are. On four they are not, and nothing raises an error.

Run it and read what minitrain reports (the step and the parameters where it departs from one
process, and by how much):

    python -m minitrain.exercises run debug_ddp_more_ranks
    python mine.py                       (the same, on your copy)

Then fix your copy and check it:

    python -m minitrain.exercises check debug_ddp_more_ranks mine.py
"""
import numpy as np

import minitrain as mt
from minitrain.comm import all_reduce
from minitrain.nn import Linear, ReLU, Sequential
from minitrain.nn import functional as F
from minitrain.optim import SGD


def train(comm, steps=3, batch=12, lr=0.1):
    mt.manual_seed(0)
    model = Sequential(Linear(4, 8), ReLU(), Linear(8, 2))
    model.to(np.float64)                               # the same start on every rank (same seed)
    opt = SGD(model.parameters(), lr=lr)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((steps, batch, 4)), rng.standard_normal((steps, batch, 2))
    share = batch // comm.size
    mine = slice(comm.rank * share, (comm.rank + 1) * share)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(mt.Tensor(X[step, mine])), mt.Tensor(Y[step, mine]))
        loss.backward()
        for q in model.parameters():                   # synchronise the gradients
            q.grad[...] = all_reduce(comm, q.grad, op="mean")
        losses.append(float(all_reduce(comm, np.array([float(loss.data)]), op="mean")[0]))
        opt.step()
    return losses, {name: q.data.copy() for name, q in model.named_parameters()}


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_ddp_more_ranks")

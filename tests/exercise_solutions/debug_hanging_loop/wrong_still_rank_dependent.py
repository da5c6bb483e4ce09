"""Every rank now joins the all-gather on odd steps, but rank 0 still calls it on every step."""
import numpy as np

from minitrain import backend
from minitrain.comm import all_reduce, ring_all_gather


def train(comm, steps=4, batch=12, lr=0.1):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(3)                              # the same start on every rank
    X = rng.standard_normal((steps, batch, 3))
    Y = X @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.standard_normal((steps, batch))
    w, X, Y = (backend.to_device(a) for a in (w, X, Y))     # on the GPU with MINITRAIN_DEVICE=cuda
    share = batch // comm.size
    mine = slice(comm.rank * share, (comm.rank + 1) * share)
    losses = []
    for step in range(steps):
        x, y = X[step, mine], Y[step, mine]
        err = x @ w - y
        grad = all_reduce(comm, 2 * x.T @ err / len(y), op="mean")
        losses.append(float(all_reduce(comm, (err ** 2).mean().reshape(1), op="mean")[0]))
        if comm.rank == 0 or step % 2 == 1:                 # log the samples each rank saw
            counts = ring_all_gather(comm, backend.to_device(np.array([len(y)])), total=comm.size)
            print(f"step {step}: loss {losses[-1]:.4f}, samples per rank {counts.tolist()}")
        w = w - lr * grad
    return losses, w


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_hanging_loop")

EXPECT = ['hung', 'ring_all_gather']

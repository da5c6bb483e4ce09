"""Debugging exercise debug_pipeline_hang: a pipeline step that never finishes.

train(comm, microbatches) runs one training step of a pipeline: stage s = comm.rank holds one
tanh layer; activations go forward with comm.send / comm.recv, gradients come back the same way,
in the 1F1B order (a warm-up of forwards, then one forward / one backward, then the remaining
backwards). It should return (loss, grad_w, peak): the loss (on the last stage, None elsewhere),
this stage's weight gradient, and the most micro-batches this stage held at once, equal to one
process running the whole model, with at most min(p - s, m) micro-batches held on stage s.
On one stage it works. On two it hangs.

Run it and read what minitrain reports (which stage waits for whom, at which line):

    python -m minitrain.exercises run debug_pipeline_hang
    python mine.py                       (the same, on your copy)
    mpiexec -n 2 python mine.py          (under MPI: minitrain's timeout ends the job)

Then fix your copy and check it:

    python -m minitrain.exercises check debug_pipeline_hang mine.py
"""
import numpy as np

from minitrain import backend


def train(comm, microbatches=4):
    p, s, m = comm.size, comm.rank, microbatches
    rng = np.random.default_rng(0)
    w = rng.standard_normal((p, 4, 4))[s] * 0.5            # this stage's layer
    X, Y = rng.standard_normal((m, 2, 4)), rng.standard_normal((m, 2, 4))
    w, X, Y = (backend.to_device(a) for a in (w, X, Y))     # on the GPU with MINITRAIN_DEVICE=cuda
    xp = backend.array_module(w)                            # NumPy, or CuPy on the GPU

    warmup = min(p - s - 1, m)                              # forwards before the first backward
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]

    saved, grad_w, loss, peak = {}, xp.zeros_like(w), 0.0, 0
    for kind, i in order:
        if kind == "F":
            x = X[i] if s == 0 else comm.recv(xp.empty((2, 4)), s - 1, tag=i)
            h = xp.tanh(x @ w)
            saved[i] = (x, h)
            peak = max(peak, len(saved))
            if s < p - 1:
                comm.send(h, s + 1, tag=i)
            else:
                loss += float(((h - Y[i]) ** 2).sum()) / m
        else:
            x, h = saved.pop(i)
            if s == p - 1:
                dh = 2 * (h - Y[i]) / m
            else:
                dh = comm.recv(xp.empty((2, 4)), s + 1, tag=1000 + i)
            dz = dh * (1 - h ** 2)
            grad_w += x.T @ dz
            if s > 0:
                comm.send(dz @ w.T, s - 1, tag=1000 + i)
    return (loss if s == p - 1 else None), grad_w, peak


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_pipeline_hang")

"""Runs every forward first (GPipe): it finishes and is exact, but holds all m micro-batches."""
import numpy as np

from minitrain import backend


def train(comm, microbatches=4):
    p, s, m = comm.size, comm.rank, microbatches
    rng = np.random.default_rng(0)
    w = rng.standard_normal((p, 4, 4))[s] * 0.5            # this stage's layer
    X, Y = rng.standard_normal((m, 2, 4)), rng.standard_normal((m, 2, 4))
    w, X, Y = (backend.to_device(a) for a in (w, X, Y))     # on the GPU with MINITRAIN_DEVICE=cuda
    xp = backend.array_module(w)                            # NumPy, or CuPy on the GPU

    warmup = m                                              # forwards before the first backward
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

EXPECT = ['1F1B holds at most']

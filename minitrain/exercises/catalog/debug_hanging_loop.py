"""Debugging exercise: a collective called inside `if comm.rank == 0:` (logging) hangs the job.
Grader: the fixed program finishes at p = 1..4 within the wait timeout and its losses and weights
equal one process training on the whole batch."""
import numpy as np

from ..debugging import load_program, program_checks, run_report

TITLE = "debug: a data-parallel training loop that hangs on two ranks"
ORDER = 200
KIND = "debug"
NOTEBOOK = "13_debugging_hangs"
DEFINES = "train"
STEPS, BATCH, FEATURES, LR = 4, 12, 3, 0.1

STUB = '''"""Debugging exercise debug_hanging_loop: a data-parallel training loop that hangs.

train(comm) fits a linear model data-parallel: every rank takes its share of each batch, the
gradients are averaged with an all-reduce, and rank 0 logs how many samples each rank saw. It
should return (losses, w): the loss of every step averaged over the ranks, and the final weights,
equal to one process training on the whole batch. On one rank it works. On two it never finishes.

Run it and read what minitrain reports (which rank waits, in which collective, at which line):

    python -m minitrain.exercises run debug_hanging_loop
    python mine.py                       (the same, on your copy)
    mpiexec -n 2 python mine.py          (under MPI: minitrain's timeout ends the job)

Then fix your copy and check it:

    python -m minitrain.exercises check debug_hanging_loop mine.py
"""
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
        if comm.rank == 0 and step % 2 == 1:                # log the samples each rank saw
            counts = ring_all_gather(comm, backend.to_device(np.array([len(y)])), total=comm.size)
            print(f"step {step}: loss {losses[-1]:.4f}, samples per rank {counts.tolist()}")
        w = w - lr * grad
    return losses, w


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_hanging_loop")
'''

FIX = (('''        if comm.rank == 0 and step % 2 == 1:                # log the samples each rank saw
            counts = ring_all_gather(comm, backend.to_device(np.array([len(y)])), total=comm.size)
            print(''', '''        if step % 2 == 1:                                   # log the samples each rank saw
            counts = ring_all_gather(comm, backend.to_device(np.array([len(y)])), total=comm.size)     # every rank takes part
            if comm.rank == 0:
                print('''),)

HINTS = (
    "Read the report rank by rank: which collective is each rank waiting in, and at which line? "
    "Rank 0 and the others are not waiting in the same collective call.",
    "A collective is a meeting: every rank of the communicator must call it, in the same order. The "
    "logging calls ring_all_gather on rank 0 only, so rank 0 waits for partners that have moved on to "
    "the next step's all_reduce, where they wait for rank 0.",
    "Let every rank take part in the all-gather and keep only the print on rank 0: "
    "if step % 2 == 1: counts = ring_all_gather(...); if comm.rank == 0: print(...).",
)


def _one_process():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(FEATURES)
    X = rng.standard_normal((STEPS, BATCH, FEATURES))
    Y = X @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.standard_normal((STEPS, BATCH))
    losses = []
    for step in range(STEPS):
        err = X[step] @ w - Y[step]
        losses.append(float(np.mean(err ** 2)))
        w = w - LR * 2 * X[step].T @ err / BATCH
    return losses, w


def compare(p, results):
    want_losses, want_w = _one_process()
    problems = []
    for r, result in enumerate(results):
        try:
            losses, w = result
        except (TypeError, ValueError):
            return [f"rank {r}: train returned {type(result).__name__}, expected (losses, w)"]
        if not np.allclose(losses, want_losses, rtol=1e-10, atol=1e-12):
            problems.append(f"rank {r}: losses {np.round(losses, 6).tolist()}, one process {np.round(want_losses, 6).tolist()}")
        if not np.allclose(w, want_w, rtol=1e-10, atol=1e-12):
            problems.append(f"rank {r}: final weights {np.round(w, 6).tolist()}, one process {np.round(want_w, 6).tolist()}")
    return problems


def broken():
    return load_program("debug_hanging_loop", STUB).train


def reference():
    return load_program("debug_hanging_loop", STUB, FIX, "fixed").train


def checks():
    return program_checks(compare, hint=1, label="finishes (no rank waits forever) and equals one process")


def run(impl, p):
    return run_report("debug_hanging_loop", impl, p or 2, compare)

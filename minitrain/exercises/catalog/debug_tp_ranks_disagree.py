"""Debugging exercise: a tensor-parallel MLP whose row-parallel layer forgets g (the forward
all-reduce of the partial sums). Grader: the fixed program's losses (the same on every rank) and
weight shards after 3 SGD steps equal the unsplit MLP's at t = 1..4, with Megatron's count of
all-reduces: one forward (g) and one backward (f) per step."""
import numpy as np

from ..debugging import load_program, program_checks, run_report
from ..comparing import host_all

TITLE = "debug: a tensor-parallel MLP whose ranks disagree"
ORDER = 230
KIND = "debug"
NOTEBOOK = "06_tensor_parallel"
DEFINES = "train"
STEPS, LR, HIDDEN = 3, 0.1, 12

STUB = '''"""Debugging exercise debug_tp_ranks_disagree: a tensor-parallel MLP that trains the wrong model.

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
        y = h @ B_r                                # the row-parallel layer's output
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
'''

FIX = (("        y = h @ B_r                                # the row-parallel layer's output",
        "        y = g.apply(h @ B_r, comm)                 # the row-parallel layer's output: sum the partial products"),)

HINTS = (
    "Compare the ranks with each other first: in tensor parallelism every rank must compute the same "
    "output and the same loss. Do they? Then count the all-reduces per step against Megatron's: one "
    "in forward (g), one in backward (f), for each MLP.",
    "Rank r computes ReLU(X A_r) B_r: one of t partial sums of Y = ReLU(X A) B. Something must add "
    "them before the loss; f does nothing in forward, and nothing else communicates in forward.",
    "The row-parallel layer's output goes through g: y = g.apply(h @ B_r, comm) (all-reduce forward, "
    "identity backward).",
)


def _one_process():
    import minitrain as mt
    from minitrain.nn import functional as F
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((8, 5)), rng.standard_normal((8, 3))
    E = mt.Tensor(rng.standard_normal((5, 5)) * 0.5, requires_grad=True)
    A = mt.Tensor(rng.standard_normal((5, HIDDEN)) * 0.5, requires_grad=True)
    B = mt.Tensor(rng.standard_normal((HIDDEN, 3)) * 0.5, requires_grad=True)
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(((mt.Tensor(X) @ E) @ A).relu() @ B, mt.Tensor(Y))
        E.grad = A.grad = B.grad = None
        loss.backward()
        losses.append(float(loss.data))
        for w in (E, A, B):
            w.data -= LR * w.grad
    return host_all((losses, E.data, A.data, B.data))


def compare(t, results):
    want_losses, E, A, B = _one_process()
    n = HIDDEN // t
    problems = []
    for r, result in enumerate(results):
        try:
            losses, E_r, A_r, B_r, all_reduces = result
        except (TypeError, ValueError):
            return [f"rank {r}: train returned {type(result).__name__}, expected (losses, E, A_r, B_r, all_reduces)"]
        where = f"t={t}, rank {r}"
        if not np.allclose(losses, want_losses, rtol=1e-10, atol=1e-12):
            problems.append(f"{where}: losses {np.round(losses, 5).tolist()}, the unsplit MLP's "
                            f"{np.round(want_losses, 5).tolist()}")
        elif not (np.allclose(E_r, E, rtol=1e-10, atol=1e-12) and np.allclose(A_r, A[:, r * n:(r + 1) * n], rtol=1e-10, atol=1e-12)
                  and np.allclose(B_r, B[r * n:(r + 1) * n], rtol=1e-10, atol=1e-12)):
            problems.append(f"{where}: the weights after {STEPS} steps differ from the unsplit model's (E, or the slices of A, B)")
        if t > 1 and all_reduces != 2 * STEPS:
            problems.append(f"{where}: {all_reduces} all-reduces in {STEPS} steps; Megatron's MLP makes 2 per step "
                            "(g in forward, f in backward)")
    if t > 1:
        finals = [np.round(res[0], 6).tolist() for res in results if isinstance(res, tuple) and len(res) == 5]
        if len({tuple(x) for x in finals}) > 1:
            problems.insert(0, f"the ranks disagree on the loss ({', '.join(f'rank {r}: {x[0]:.5f}' for r, x in enumerate(finals))} "
                               "at step 0): tensor-parallel ranks must all compute the same output")
    return problems


def broken():
    return load_program("debug_tp_ranks_disagree", STUB).train


def reference():
    return load_program("debug_tp_ranks_disagree", STUB, FIX, "fixed").train


def checks():
    return program_checks(compare, hint=1, label="the unsplit MLP's losses and weights, Megatron's all-reduces")


def run(impl, p):
    return run_report("debug_tp_ranks_disagree", impl, p or 2, compare)

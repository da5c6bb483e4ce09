"""Debugging exercise: a hand-written ZeRO-1 loop whose shard update stops one element short
(range(first, last) with an inclusive last). Grader: the fixed program's losses and weights equal
one process at p = 1..4 (N = 22: shards of 22, 11, 8 and 6 elements)."""
import numpy as np

from ..debugging import load_program, program_checks, run_report

TITLE = "debug: a ZeRO-1 loop that runs but does not match one process"
ORDER = 210
KIND = "debug"
NOTEBOOK = "04_zero"
DEFINES = "train"
STEPS, BATCH, N, LR, BETA = 3, 12, 22, 0.05, 0.9

STUB = '''"""Debugging exercise debug_zero_mismatch: ZeRO-1 that runs, but not like one process.

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
        for i in range(first, last):                          # update my shard
            w[i] -= lr * momentum[i - first]
        w = ring_all_gather(comm, w[first:last + 1].copy(), total=shard * p)
        weights.append(w[:n].copy())
    return losses, weights


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_zero_mismatch")
'''

FIX = (("        for i in range(first, last):                          # update my shard",
        "        for i in range(first, last + 1):                      # update my shard (last included)"),)

HINTS = (
    "Look at which weights differ from one process, not only that they do: their indices, and which "
    "rank's shard each one falls in. Is there a pattern at the shard boundaries?",
    "Every wrong weight is the last element of some rank's shard: that element is never updated, "
    "though its gradient and momentum are right. first and last are both inclusive here; which "
    "Python construct excludes its end?",
    "range(first, last) stops at last - 1. Loop over range(first, last + 1), or better, update the "
    "whole shard at once: w[first:last + 1] -= lr * momentum.",
)


def _one_process():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((STEPS, BATCH, N))
    Y = X @ rng.standard_normal(N)
    w, momentum, losses, weights = np.zeros(N), None, [], []
    for step in range(STEPS):
        err = X[step] @ w - Y[step]
        losses.append(float(np.mean(err ** 2)))
        grad = 2 * X[step].T @ err / BATCH
        momentum = grad if step == 0 else BETA * momentum + grad
        w = w - LR * momentum
        weights.append(w.copy())
    return losses, weights


def _position(i, shard):
    where = f"rank {i // shard}'s shard, position {i % shard} of 0..{shard - 1}"
    return f"{i} ({where}{', its last' if i % shard == shard - 1 else ''})"


def _rank_problem(r, result, want_losses, want_weights, shard):
    try:
        losses, weights = result
        weights = [np.asarray(w) for w in weights]
    except (TypeError, ValueError):
        return f"train returned {type(result).__name__}, expected (losses, weights)"
    if len(weights) != STEPS:
        return f"{len(weights)} weight vectors returned, expected one per step ({STEPS})"
    for step, (w, want) in enumerate(zip(weights, want_weights)):
        if w.shape != want.shape:
            return f"the weights after step {step} have shape {w.shape}, expected {want.shape}"
        wrong = np.flatnonzero(~np.isclose(w, want, rtol=1e-10, atol=1e-12))
        if wrong.size:
            listed = ", ".join(_position(int(i), shard) for i in wrong[:6]) + (", ..." if wrong.size > 6 else "")
            i = wrong[0]
            return (f"after step {step}, {wrong.size} of {N} weights differ from one process: {listed}. "
                    f"E.g. w[{i}] = {w[i]:.6f}, one process {want[i]:.6f}" +
                    (f" (its value before the step: {want_weights[step - 1][i]:.6f})" if step else " (it started at 0)"))
    if not np.allclose(losses, want_losses, rtol=1e-10, atol=1e-12):
        return f"losses {np.round(losses, 6).tolist()}, one process {np.round(want_losses, 6).tolist()}"
    return None


def compare(p, results):
    want_losses, want_weights = _one_process()
    shard = -(-N // p)
    found = [(r, _rank_problem(r, res, want_losses, want_weights, shard)) for r, res in enumerate(results)]
    found = [(r, text) for r, text in found if text]
    if len(found) == p > 1 and len({text for _, text in found}) == 1:
        return [f"every rank (0-{p - 1}): {found[0][1]}"]
    return [f"rank {r}: {text}" for r, text in found]


def broken():
    return load_program("debug_zero_mismatch", STUB).train


def reference():
    return load_program("debug_zero_mismatch", STUB, FIX, "fixed").train


def checks():
    return program_checks(compare, hint=1, label="equals one process (losses and every weight)")


def run(impl, p):
    return run_report("debug_zero_mismatch", impl, p or 4, compare)

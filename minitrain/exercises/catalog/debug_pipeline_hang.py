"""Debugging exercise: a hand-written 1F1B pipeline step with blocking send/recv whose warm-up
count is reversed (stage s warms up with s forwards instead of p-s-1): the first two stages wait for
each other. Grader: the fixed program finishes at p = 1..4 for m = 1, 2, 3, 5 micro-batches, its
loss and every stage's weight gradient equal one process, and no stage holds more than 1F1B's
min(p-s, m) micro-batches (running GPipe instead fails that)."""
import numpy as np

from ..debugging import load_program, run_report
from ..comparing import host_all
from ..grading import Check, Mismatch
from ..harness import RanksFailed, run_ranks

TITLE = "debug: a pipeline step that never finishes"
ORDER = 220
KIND = "debug"
NOTEBOOK = "05_pipeline"
DEFINES = "train"
MICROBATCHES = (1, 2, 3, 5)

STUB = '''"""Debugging exercise debug_pipeline_hang: a pipeline step that never finishes.

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

    warmup = min(s, m)                                      # forwards before the first backward
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
'''

FIX = (("    warmup = min(s, m)                                      # forwards before the first backward",
        "    warmup = min(p - s - 1, m)                              # forwards before the first backward"),)

HINTS = (
    "Read the two waits together: stage 0 waits for something from stage 1 while stage 1 waits for "
    "something from stage 0. Which micro-batch does each expect, and is it a forward or a backward "
    "(the tags say: i for activations, 1000 + i for gradients)?",
    "Write down each stage's order of actions for p = 2, m = 4 (print `order`). Stage 0 runs a "
    "backward before stage 1 can send it a gradient, because stage 1 first wants another forward "
    "input that stage 0 will only send after that backward. The warm-up counts are the wrong way "
    "round: which stage must run the most forwards before its first backward?",
    "Stage s must keep the p - s - 1 stages after it busy until the first gradient returns: warmup = "
    "min(p - s - 1, m). The last stage needs no warm-up. (Running every forward first, GPipe, also "
    "finishes, but holds m micro-batches per stage: the grader asks for 1F1B's min(p - s, m).)",
)


def _one_process(p, m):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((p, 4, 4)) * 0.5
    X, Y = rng.standard_normal((m, 2, 4)), rng.standard_normal((m, 2, 4))
    loss, grads = 0.0, np.zeros_like(weights)
    for i in range(m):
        xs, h = [], X[i]
        for s in range(p):
            xs.append(h)
            h = np.tanh(h @ weights[s])
        loss += float(((h - Y[i]) ** 2).sum()) / m
        dh, hs = 2 * (h - Y[i]) / m, None
        for s in reversed(range(p)):
            hs = np.tanh(xs[s] @ weights[s])
            dz = dh * (1 - hs ** 2)
            grads[s] += xs[s].T @ dz
            dh = dz @ weights[s].T
    return loss, grads


def compare_m(p, m, results):
    loss, grads = _one_process(p, m)
    problems = []
    for s, result in enumerate(results):
        try:
            got_loss, grad_w, peak = result
        except (TypeError, ValueError):
            return [f"stage {s}: train returned {type(result).__name__}, expected (loss, grad_w, peak)"]
        where = f"p={p}, m={m}, stage {s}"
        if s == p - 1 and (got_loss is None or not np.isclose(got_loss, loss, rtol=1e-12, atol=1e-14)):
            problems.append(f"{where}: loss {got_loss}, one process {loss}")
        if not np.allclose(grad_w, grads[s], rtol=1e-10, atol=1e-13):
            problems.append(f"{where}: the weight gradient differs from one process (max difference "
                            f"{np.abs(np.asarray(grad_w) - grads[s]).max():.3g})")
        if peak > min(p - s, m):
            problems.append(f"{where}: held {peak} micro-batches at once; 1F1B holds at most min(p - s, m) = "
                            f"{min(p - s, m)} (GPipe's order, every forward first, holds all m)")
    return problems


def compare(p, results):
    return compare_m(p, 4, results)


def _check(train, p):
    for m in MICROBATCHES:
        try:
            results = run_ranks(p, lambda comm: train(comm, microbatches=m))
        except RanksFailed as e:
            raise RanksFailed(f"with m = {m} micro-batches: {e}") from None
        problems = compare_m(p, m, host_all(results))
        if problems:
            raise Mismatch("\n".join(problems))


def broken():
    return load_program("debug_pipeline_hang", STUB).train


def reference():
    return load_program("debug_pipeline_hang", STUB, FIX, "fixed").train


def checks():
    return [Check(f"p={p}: m = 1, 2, 3, 5 finish, equal one process, hold <= min(p-s, m)",
                  lambda f, p=p: _check(f, p), 2) for p in (1, 2, 3, 4)]


def run(impl, p):
    return run_report("debug_pipeline_hang", impl, p or 2, compare)

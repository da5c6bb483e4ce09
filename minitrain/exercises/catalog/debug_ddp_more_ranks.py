"""Debugging exercise: hand-written data parallelism that sums the gradients instead of averaging
them. Grader: the fixed program's losses and parameters after 3 SGD steps equal one process on the
global batch at p = 1..4 (float64, 1e-10); the library's DistributedDataParallel is the reference."""
import numpy as np

from ..debugging import load_program, program_checks, run_report
from ..comparing import host_all

TITLE = "debug: data parallelism that trains differently on more ranks"
ORDER = 240
KIND = "debug"
NOTEBOOK = "03_data_parallel"
DEFINES = "train"
STEPS, BATCH, LR = 3, 12, 0.1

STUB = '''"""Debugging exercise debug_ddp_more_ranks: data parallelism that trains differently on more ranks.

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
            q.grad[...] = all_reduce(comm, q.grad, op="sum")
        losses.append(float(all_reduce(comm, np.array([float(loss.data)]), op="mean")[0]))
        opt.step()
    return losses, {name: q.data.copy() for name, q in model.named_parameters()}


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_ddp_more_ranks")
'''

FIX = (('            q.grad[...] = all_reduce(comm, q.grad, op="sum")',
        '            q.grad[...] = all_reduce(comm, q.grad, op="mean")'),)

HINTS = (
    "Look at the first step that differs and at the size of the difference: how much did each "
    "parameter move in that step, compared with one process? Try -p 2 and -p 4: does the factor "
    "follow the number of ranks?",
    "Each rank's loss is the mean over its share of the batch, so its gradient is the gradient of "
    "that mean. One process's gradient, of the mean over the whole batch, is the average of the "
    "ranks' gradients, not their sum: summing makes every step p times too large.",
    "All-reduce with op='mean' (or divide the sum by comm.size). minitrain's DistributedDataParallel "
    "does this for you, bucket by bucket, overlapping backward.",
)


def _model():
    import minitrain as mt
    from minitrain.nn import Linear, ReLU, Sequential
    mt.manual_seed(0)
    model = Sequential(Linear(4, 8), ReLU(), Linear(8, 2))
    model.to(np.float64)
    return model


def _one_process(steps=STEPS):
    """Per step: (loss, parameters after the step); one process on the whole batch."""
    import minitrain as mt
    from minitrain.nn import functional as F
    from minitrain.optim import SGD
    model = _model()
    opt = SGD(model.parameters(), lr=LR)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((steps, BATCH, 4)), rng.standard_normal((steps, BATCH, 2))
    start = {n: q.data.copy() for n, q in model.named_parameters()}
    history = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(mt.Tensor(X[step])), mt.Tensor(Y[step]))
        loss.backward()
        opt.step()
        history.append((float(loss.data), {n: q.data.copy() for n, q in model.named_parameters()}))
    return host_all((start, history))


def _both(comm, train):
    """The program as asked (3 steps), and once more for one step: the size of a single update."""
    return train(comm), train(comm, steps=1)


def compare(p, results):
    start, history = _one_process()
    want_losses = [loss for loss, _ in history]
    final, first = history[-1][1], _one_process(steps=1)[1][0][1]
    problems = []
    for r, pair in enumerate(results):
        try:
            (losses, params), (_, params_1) = pair
        except (TypeError, ValueError):
            return [f"rank {r}: train returned {type(pair[0]).__name__}, expected (losses, params)"]
        bad_steps = [s for s, (a, b) in enumerate(zip(losses, want_losses)) if not np.isclose(a, b, rtol=1e-10, atol=1e-12)]
        wrong = [n for n in final if n not in params or not np.allclose(params[n], final[n], rtol=1e-10, atol=1e-12)]
        if not bad_steps and not wrong:
            continue
        text = f"rank {r}: losses {np.round(losses, 5).tolist()}, one process {np.round(want_losses, 5).tolist()}"
        if bad_steps and bad_steps[0]:
            text += f" (equal up to step {bad_steps[0] - 1}, then they part)"
        if wrong:
            text += f"; after {STEPS} steps {len(wrong)} of {len(final)} parameters differ"
        ratios = []
        for name in first:
            if name in params_1:
                moved, want_moved = params_1[name] - start[name], first[name] - start[name]
                nonzero = np.abs(want_moved) > 1e-14
                if nonzero.any():
                    ratios.append(moved[nonzero] / want_moved[nonzero])
        if ratios:
            ratio = np.concatenate(ratios)
            if np.allclose(ratio, ratio[0], rtol=1e-8) and not np.isclose(ratio[0], 1.0):
                text += (f". In the first step every parameter moved {ratio[0]:.4g} times as far as in one process"
                         + (f" (p = {p})" if np.isclose(ratio[0], p) else f" (1/p, p = {p})" if np.isclose(ratio[0], 1 / p)
                            else ""))
        problems.append(text)
    if len(problems) == p > 1 and len({q.split(':', 1)[1] for q in problems}) == 1:
        return [f"every rank (0-{p - 1}):{problems[0].split(':', 1)[1]}"]
    return problems


def broken():
    return load_program("debug_ddp_more_ranks", STUB).train


def reference():
    """minitrain's DistributedDataParallel in the program's place."""
    def train(comm, steps=STEPS, batch=BATCH, lr=LR):
        import minitrain as mt
        from minitrain.comm import all_reduce
        from minitrain.nn import functional as F
        from minitrain.optim import SGD
        from minitrain.parallel import DistributedDataParallel
        model = _model()
        ddp = DistributedDataParallel(model, comm)
        opt = SGD(model.parameters(), lr=lr)
        rng = np.random.default_rng(0)
        X, Y = rng.standard_normal((steps, batch, 4)), rng.standard_normal((steps, batch, 2))
        share = batch // comm.size
        mine = slice(comm.rank * share, (comm.rank + 1) * share)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(ddp(mt.Tensor(X[step, mine])), mt.Tensor(Y[step, mine]))
            loss.backward()
            losses.append(float(all_reduce(comm, np.array([float(loss.data)]), op="mean")[0]))
            opt.step()
        return losses, {name: q.data.copy() for name, q in model.named_parameters()}
    return train


def checks():
    return program_checks(compare, hint=2, label="losses and parameters equal one process on the global batch", call=_both)


def run(impl, p):
    return run_report("debug_ddp_more_ranks", impl, p or 4, compare, call=_both)

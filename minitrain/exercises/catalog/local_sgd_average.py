"""Grader: local SGD's periodic averaging (Stich 2019; Lin et al. 2020; PyTorch's PeriodicModelAverager),
in minitrain's LocalSGD's shape. At p = 1..4 every rank holds the ranks' mean of the parameters after an
averaging step (float64, 1e-12), their gradients untouched; over steps 1..N it averages exactly after
the multiples of sync_every, and in between touches nothing and sends nothing; an MLP trained on 2 and
3 ranks, each on its own data, with it == with minitrain's LocalSGD, step for step."""
import numpy as np

from ..comparing import compare, host, to_learner
from ..grading import Check, Mismatch
from ..harness import run_ranks
from ..oracles import traffic

TITLE = "local SGD: each replica steps alone, the parameters averaged every sync_every steps"
ORDER = 95
KIND = "implement"
NOTEBOOK = "03_data_parallel"
DEFINES = "average_parameters"
SHAPES = ((3, 4), (4,), (2, 3, 2))
SCHEDULES = ((2, 4, 9), (3, 3, 7), (4, 1, 3))          # (p, sync_every, steps)

STUB = '''"""Exercise local_sgd_average: local SGD (Stich 2019, "Local SGD Converges Fast and Communicates
Little"; Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD"). DDP averages the
gradients at every step, so the replicas never differ. Local SGD lets each replica step alone, on
its own gradients, and averages the parameters themselves only every sync_every steps: one
all-reduce of the parameters per sync_every steps instead of one of the gradients per step, paid
for by replicas that drift apart in between. minitrain's LocalSGD calls this after each
optimizer step, as PyTorch's PeriodicModelAverager.average_parameters is called (minitrain has no
warm-up: its averaging starts with the first period).

Write average_parameters(comm, params, step, sync_every), called on every rank after the
optimizer's step number `step`.

Contract:
  - params: this rank's replica's parameters (minitrain Parameters: q.data the values, q.grad the
    gradient this rank's last backward left); every rank passes its own, in the same order;
  - step counts the optimizer steps taken so far, from 1 (the first call has step 1); every rank
    calls with the same step and sync_every;
  - when step is a multiple of sync_every: set every q.data to the mean over the ranks of that
    parameter (every rank then holds the same replica) and return True;
  - otherwise: change nothing, send nothing, return False;
  - never change q.grad;
  - arrays live where the parameters do (NumPy on the CPU, CuPy on the GPU): no np. on them.

From minitrain.comm: all_reduce(comm, x, op="mean") returns a new array, the mean over the
ranks; all_reduce_coalesced(comm, arrays, op="mean") reduces several arrays in place, as one message.

The test to pass:
  - p = 1..4, step 4 of sync_every 4: every rank's parameters == the ranks' mean (float64, 1e-12),
    gradients untouched, True returned;
  - steps 1..9 with sync_every 4 (and 1..7 with 3, 1..3 with 1): averaged after steps 4 and 8
    only; in between parameters untouched, nothing sent, False returned;
  - an MLP trained 8 steps on 2 and 3 ranks, each on its own data, with your function == with
    minitrain's LocalSGD, step for step.

Check it:  python -m minitrain.exercises check local_sgd_average mine.py
Stuck?     python -m minitrain.exercises hint local_sgd_average
"""
from minitrain.comm import all_reduce, all_reduce_coalesced


def average_parameters(comm, params, step, sync_every):
    raise NotImplementedError("average_parameters: every sync_every steps, the ranks' mean of each parameter")
'''

HINTS = (
    "Two questions: when, and what. When: step counts the optimizer steps taken so far, from 1, so the k-th "
    "step is the first to average (step 0 never comes). Between averagings do nothing at all, not even a "
    "collective call: that silence is what local SGD saves. What: the parameters' values, q.data; each "
    "replica has already stepped on its own gradients, and averaging those now would change nothing.",
    "The average over the ranks is an all-reduce with op='mean' (a sum leaves every replica p times too "
    "large). all_reduce(comm, q.data, op='mean') returns a new array: write it into the parameter, "
    "q.data[...] = it. Every rank calls with the same step, so every rank makes the same collective calls.",
    "if step % sync_every: return False. Then all_reduce_coalesced(comm, [q.data for q in params], "
    "op='mean') (one message for all, written back in place, as minitrain's LocalSGD does), or for each "
    "parameter q.data[...] = all_reduce(comm, q.data, op='mean'); return True.",
)


def _params(rank):
    """Rank ``rank``'s replica: its values differ from the other ranks', and so do its gradients."""
    from ...nn import Parameter
    rng = np.random.default_rng(100 + rank)
    params = [Parameter(to_learner(rng.standard_normal(s))) for s in SHAPES]
    for q in params:
        q.grad = to_learner(rng.standard_normal(q.shape))
    return params


def _snapshot(params):
    return [(host(q.data).copy(), None if q.grad is None else host(q.grad).copy()) for q in params]


def _call(comm, impl, params, step, k):
    """impl after step ``step``: (before, what it returned, after, bytes and messages it sent)."""
    before, box = _snapshot(params), {}
    sent = traffic(comm, lambda: box.update(returned=impl(comm, params, step, k)))
    return before, box["returned"], _snapshot(params), sent


def _local_step(params, rank, step):
    """What a replica's own optimizer step does to it: values and gradients move, differently per rank."""
    rng = np.random.default_rng(1000 * step + rank)
    for q in params:
        q.data[...] += to_learner(0.1 * rng.standard_normal(q.shape))
        q.grad = to_learner(rng.standard_normal(q.shape))


def _verdict(calls, p, step, k):
    """What the ranks' call after ``step`` did, 'mean' or 'untouched' (a Mismatch for other values or a
    gradient changed), and the problems to report once the steps that averaged are right."""
    mean = [np.mean([calls[r][0][i][0] for r in range(p)], axis=0) for i in range(len(SHAPES))]
    grads = [np.mean([calls[r][0][i][1] for r in range(p)], axis=0) for i in range(len(SHAPES))]
    seen, later = set(), []
    for r, (before, returned, after, (sent, messages)) in enumerate(calls):
        where = f"p={p}, sync_every={k}, after step {step}, rank {r}"
        if all(np.array_equal(a[0], b[0]) for a, b in zip(after, before)):
            seen.add("untouched")
        elif all(compare(a[0], m, "", rtol=1e-12, atol=1e-12) is None for a, m in zip(after, mean)):
            seen.add("mean")
        else:
            i = next(i for i, (a, m) in enumerate(zip(after, mean)) if compare(a[0], m, "", 1e-12, 1e-12))
            raise Mismatch(compare(after[i][0], mean[i], f"{where}: parameter {i}", 1e-12, 1e-12, ranks=p)
                           + " (the mean over the ranks of that parameter is expected)")
        if any(not np.array_equal(a[1], b[1]) for a, b in zip(after, before)):
            why = ("you averaged the gradients, DDP's move before a step; local SGD averages the parameters "
                   "themselves, after each replica has stepped on its own gradients"
                   if all(a[1] is not None and np.allclose(a[1], g, rtol=1e-12, atol=1e-12)
                          for a, g in zip(after, grads))
                   else "leave q.grad as it is")
            raise Mismatch(f"{where}: q.grad changed: {why}")
        want = step % k == 0
        if not isinstance(returned, (bool, np.bool_)) or bool(returned) != want:
            later.append(f"{where}: returned {returned!r}, expected {want}: step {step} is {'' if want else 'not '}a "
                         f"multiple of sync_every {k} (step counts the optimizer steps taken, from 1)")
        if not want and sent:
            later.append(f"{where}: sent {sent} bytes in {messages} message(s) on a step that does not average; "
                         "between averagings local SGD sends nothing (that is its saving over DDP)")
    if len(seen) > 1:
        raise Mismatch(f"p={p}, after step {step}: some ranks averaged and some did not")
    return seen.pop(), later


def _at_a_period(impl, p):
    def rank(comm):
        return _call(comm, impl, _params(comm.rank), 4, 4)
    done, later = _verdict(run_ranks(p, rank), p, 4, 4)
    if later:
        raise Mismatch(later[0])
    if done != "mean" and p > 1:
        raise Mismatch(f"p={p}, step 4 of sync_every=4: the parameters are unchanged; set each q.data to the "
                       f"ranks' mean (all_reduce returns a new array: write it back, q.data[...] = ...)")


def _schedule(impl, p, k, steps):
    def rank(comm):
        params, calls = _params(comm.rank), []
        for step in range(1, steps + 1):
            _local_step(params, comm.rank, step)
            calls.append(_call(comm, impl, params, step, k))
        return calls
    runs = run_ranks(p, rank)
    verdicts = [_verdict([run[s - 1] for run in runs], p, s, k) for s in range(1, steps + 1)]
    done = [s for s, (kind, _) in enumerate(verdicts, 1) if kind == "mean"]
    want = list(range(k, steps + 1, k))
    claimed = [s for s, call in enumerate(runs[0], 1) if call[1] is True or call[1] is np.True_]
    if done != want and not done and claimed == want:
        raise Mismatch(f"p={p}, sync_every={k}: returned True after steps {want}, but the parameters are unchanged: "
                       f"write the ranks' mean into each q.data (all_reduce returns a new array: q.data[...] = it)")
    if done != want:
        slip = {tuple(s for s in range(1, steps + 1) if (s - 1) % k == 0): ": as if step counted from 0",
                tuple(s for s in range(1, steps + 1) if (s + 1) % k == 0): ": one step early"}.get(tuple(done), "")
        raise Mismatch(f"p={p}, sync_every={k}, steps 1..{steps}: averaged after steps {done or 'none'}, expected "
                       f"after {want}{slip}; step is the number of optimizer steps taken, from 1: average when "
                       f"it is a multiple of sync_every")
    later = [problem for _, problems in verdicts for problem in problems]
    if later:
        raise Mismatch(later[0])


def _mlp():
    from ... import manual_seed, nn
    manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(np.float64)


def _trains_as_local_sgd(impl, p, k, steps=8):
    def rank(comm):
        from ...autograd import Tensor
        from ...nn import functional as F
        from ...optim import SGD
        from ...parallel import LocalSGD
        mine, theirs = _mlp(), _mlp()
        local = LocalSGD(theirs, comm, sync_every=k)
        opts = [SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (mine, theirs)]
        rng, states = np.random.default_rng(10 + comm.rank), []
        for step in range(1, steps + 1):
            x, y = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))    # this rank's own batch
            for model, opt in zip((mine, theirs), opts):
                opt.zero_grad()
                F.mse_loss(model(Tensor(to_learner(x))), Tensor(to_learner(y))).backward()
                opt.step()
            local.step()
            impl(comm, list(mine.parameters()), step, k)
            states.append([(n, host(q.data).copy(), host(t.data).copy())
                           for (n, q), t in zip(mine.named_parameters(), theirs.parameters())])
        return states
    for r, states in enumerate(run_ranks(p, rank)):
        for step, state in enumerate(states, 1):
            for name, got, want in state:
                problem = compare(got, want, f"p={p}, sync_every={k}, rank {r}, after step {step}: {name}",
                                  rtol=1e-12, atol=1e-12, ranks=p)
                if problem:
                    raise Mismatch(problem + " (trained with minitrain's LocalSGD instead)")


def checks():
    out = [Check(f"p={p}: sync_every {k}, steps 1..{n}: averages after the multiples of {k} only, silent between",
                 lambda f, p=p, k=k, n=n: _schedule(f, p, k, n), 1) for p, k, n in SCHEDULES]
    out += [Check(f"p={p}: step 4 of sync_every 4, every rank holds the ranks' mean", lambda f, p=p: _at_a_period(f, p),
                  1 if p == 1 else 2) for p in (1, 2, 3, 4)]          # (at p = 1 only the step can be wrong)
    out += [Check(f"p={p}: an MLP trained 8 steps, sync_every {k}, == minitrain's LocalSGD",
                  lambda f, p=p, k=k: _trains_as_local_sgd(f, p, k), 3) for p, k in ((2, 3), (3, 2))]
    return out


def reference():
    """minitrain's LocalSGD on the given parameters, its step counter at step - 1."""
    from ...parallel import LocalSGD

    class Replica:                     # the module whose parameters LocalSGD averages
        def __init__(self, params):
            self.params = list(params)

        def parameters(self):
            return self.params

    def average_parameters(comm, params, step, sync_every):
        local = LocalSGD(Replica([]), comm, sync_every=sync_every)      # (nothing to broadcast)
        local.module, local.steps = Replica(params), step - 1
        return local.step()
    return average_parameters

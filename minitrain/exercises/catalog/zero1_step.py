"""Grader: the learner's ZeRO-1 step, three steps of SGD with momentum (lr and momentum other than
the defaults) at p = 1..4 on flat parameters of awkward lengths (1, 3, 13, 50), against one process
stepping on the averaged gradient (minitrain's SGD, float64, 1e-12) and against minitrain's
ZeroRedundancyOptimizer(stage=1); the optimizer state must be this rank's padded shard only, and the
traffic one reduce-scatter plus one all-gather (an all-reduce of the gradient on top fails)."""
import numpy as np

from ..comparing import compare, host, to_learner
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "ZeRO-1's sharded optimizer step (reduce-scatter, step a shard, all-gather)"
ORDER = 100
KIND = "implement"
NOTEBOOK = "04_zero"
DEFINES = "zero1_step"
LENGTHS = (1, 3, 13, 50)
#: not zero1_step's defaults (0.1, 0.9): a step that ignores its lr and momentum arguments fails
STEPS, LR, MOMENTUM = 3, 0.05, 0.8

STUB = '''"""Exercise zero1_step: ZeRO stage 1 (Rajbhandari et al. 2020, section 5.1): each rank keeps
the optimizer state of 1/p of the parameters only.

The parameters are one flat array of N elements, padded with zeros to S·p elements, S = ceil(N/p);
rank r owns the shard [r·S, (r+1)·S) of the padded array (the last shards may hold padding only).
One step of SGD with momentum (PyTorch's rule: buf = grad at the first step, then
buf = momentum·buf + grad; params -= lr·buf) goes:

  1. every rank has the gradient of its own share of the batch; each rank needs the AVERAGE over
     the ranks, but only for its shard;
  2. each rank updates its shard of the parameters with its shard of the momentum;
  3. every rank needs every updated parameter back.

Write zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
  params  the flat float64 parameters, N elements, the same on every rank: update them in place;
  grad    this rank's flat gradient, N elements (not averaged);
  state   a dict this rank keeps between steps (empty at the first step): keep the momentum of
          your shard in state["momentum"], S elements, and nothing of the size of the model.

Communicate with minitrain.comm.ring_reduce_scatter(comm, x, op=...) (rank r gets chunk r of
np.array_split) and minitrain.comm.ring_all_gather(comm, shard, total=...).

The test to pass: three steps (lr=0.05, momentum=0.8) at p = 1, 2, 3, 4 for N = 1, 3, 13, 50: the
parameters on every rank equal one process stepping SGD on the averaged gradient, and minitrain's ZeroRedundancyOptimizer
(stage 1), to 1e-12; state["momentum"] is this rank's shard; the traffic is one reduce-scatter
and one all-gather, (p-1)·S elements each.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check zero1_step mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check zero1_step mine.py
Stuck?     python -m minitrain.exercises hint zero1_step
"""
import numpy as np

from minitrain.comm import ring_all_gather, ring_reduce_scatter


def zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
    raise NotImplementedError("zero1_step: reduce-scatter, step your shard, all-gather")
'''

HINTS = (
    "Step 1 is a reduce-scatter with op='mean': it averages and leaves each rank only its chunk. "
    "Step 3 is an all-gather of the updated shards. Together they send as much as one all-reduce: "
    "ZeRO-1 saves memory (the optimizer state) at no extra communication.",
    "Make the chunks the shards: pad the gradient to S·p elements (np.zeros, then copy grad in), so "
    "that np.array_split of the padded array gives exactly [r·S, (r+1)·S) to rank r. Do the same with "
    "the parameters before updating your shard, and all-gather S·p elements.",
    "shard_grad = ring_reduce_scatter(comm, padded_grad, op='mean'); momentum: state['momentum'] = "
    "shard_grad.copy() the first time, else m *= momentum; m += shard_grad; then padded_params[r*S:(r+1)*S] "
    "-= lr * m; full = ring_all_gather(comm, padded_params[r*S:(r+1)*S].copy(), total=S*p); "
    "params[...] = full[:N].",
)


def _grads(n, p):
    rng = np.random.default_rng([n, p])
    return rng.standard_normal((STEPS, p, n))


def _start(n):
    return np.random.default_rng([n, 7]).standard_normal(n)


def _one_process(n, p):
    import minitrain as mt
    from minitrain.optim import SGD
    q = mt.nn.Parameter(_start(n).copy())
    opt = SGD([q], lr=LR, momentum=MOMENTUM)
    for g in _grads(n, p):
        q.grad = to_learner(g.mean(axis=0))
        opt.step()
    return q.data.copy()


def _rank(comm, impl, n):
    params, state = to_learner(_start(n)), {}
    grads = _grads(n, comm.size)
    sent0 = comm.stats.bytes_sent
    for step in range(STEPS):
        out = impl(comm, params, to_learner(grads[step, comm.rank]), state, lr=LR, momentum=MOMENTUM)
        if out is not None and out is not params:
            raise Mismatch(f"rank {comm.rank}: zero1_step returned {type(out).__name__}: update params in place "
                           "(the caller keeps using the same array)")
    return params, state, (comm.stats.bytes_sent - sent0) / STEPS


def _library_rank(comm, n):
    import minitrain as mt
    from minitrain.optim import SGD
    from minitrain.parallel import ZeroRedundancyOptimizer
    q = mt.nn.Parameter(_start(n).copy())
    zero = ZeroRedundancyOptimizer([q], SGD, comm, stage=1, lr=LR, momentum=MOMENTUM)
    for g in _grads(n, comm.size):
        zero.zero_grad()
        q.grad[...] = to_learner(g[comm.rank])
        zero.step()
    return q.data.copy()


def _check(impl, p, part):
    for n in LENGTHS:
        s = -(-n // p)
        want = _one_process(n, p) if part != "library" else run_ranks(p, _library_rank, n)[0]
        results = run_ranks(p, _rank, impl, n)
        for r, (params, state, sent) in enumerate(results):
            where = f"p={p}, N={n}, rank {r}"
            if part in ("one process", "library"):
                oracle = "one process's SGD on the averaged gradient" if part == "one process" else \
                    "minitrain's ZeroRedundancyOptimizer(stage=1)"
                problem = compare(params, want, f"{where}: parameters after {STEPS} steps (lr={LR}, momentum={MOMENTUM}) "
                                  f"vs {oracle}",
                                  chunks=p if n >= p else None)
                if problem:
                    owner = ""
                    wrong = np.flatnonzero(~np.isclose(host(params), host(want), rtol=1e-10, atol=1e-12))
                    if wrong.size:
                        owners = sorted({int(i // s) for i in wrong})
                        owner = f". Wrong elements lie in the shard(s) of rank(s) {owners} (S = {s})"
                    raise Mismatch(problem + owner)
            elif part == "state":
                m = state.get("momentum") if isinstance(state, dict) else None
                if m is None:
                    raise Mismatch(f"{where}: state has no 'momentum' (keys: {sorted(state)})")
                m = host(m)
                if m.shape != (s,):
                    raise Mismatch(f"{where}: state['momentum'] has shape {m.shape}; ZeRO-1 keeps only this rank's "
                                   f"shard, S = ceil(N/p) = {s} elements (padding included)")
                sizes = {k: v.size for k, v in state.items() if hasattr(v, "size")}
                big = {k: v for k, v in sizes.items() if v > s}
                if big:
                    raise Mismatch(f"{where}: state keeps {big}: more than this rank's shard of {s} elements")
            elif part == "traffic":
                bound = 2 * (p - 1) * s * 8
                if sent > bound:
                    raise Mismatch(f"{where}: sent {sent:.0f} bytes per step; a reduce-scatter and an all-gather of "
                                   f"S·p = {s * p} float64 send 2(p-1)·S·8 = {bound}. An all-reduce of the whole "
                                   "gradient is not needed: each rank only steps its shard")


def checks():
    out = []
    for p in (1, 2, 3, 4):
        out += [Check(f"p={p}: 3 steps equal one process's SGD with momentum (N = 1, 3, 13, 50)",
                      lambda f, p=p: _check(f, p, "one process"), 2),
                Check(f"p={p}: equal to minitrain's ZeroRedundancyOptimizer(stage=1)",
                      lambda f, p=p: _check(f, p, "library"), 2),
                Check(f"p={p}: the momentum kept is this rank's shard only", lambda f, p=p: _check(f, p, "state"), 2)]
        if p > 1:
            out.append(Check(f"p={p}: traffic: one reduce-scatter and one all-gather", lambda f, p=p: _check(f, p, "traffic"), 1))
    return out


def reference():
    from minitrain.backend import array_module
    from minitrain.comm import ring_all_gather, ring_reduce_scatter

    def zero1_step(comm, params, grad, state, lr=0.1, momentum=0.9):
        xp = array_module(params)           # NumPy on the CPU, CuPy on the GPU
        p, r, n = comm.size, comm.rank, params.size
        s = -(-n // p)
        padded_grad = xp.zeros(s * p, grad.dtype)
        padded_grad[:n] = grad
        shard_grad = ring_reduce_scatter(comm, padded_grad, op="mean")
        if "momentum" not in state:
            state["momentum"] = shard_grad.copy()
        else:
            state["momentum"] *= momentum
            state["momentum"] += shard_grad
        padded = xp.zeros(s * p, params.dtype)
        padded[:n] = params
        padded[r * s:(r + 1) * s] -= lr * state["momentum"]
        params[...] = ring_all_gather(comm, padded[r * s:(r + 1) * s].copy(), total=s * p)[:n]
    return zero1_step

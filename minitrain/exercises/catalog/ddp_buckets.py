"""Grader: the learner's BucketedDDP on a small MLP with a frozen parameter. Buckets: reverse
parameter order, split at the cap (caps forcing one and several buckets, as CS336's tests do).
Gradients: every rank's equal one process on the global batch (float64, 1e-12) at p = 1..4, two
backward passes in a row. Overlap: exactly one all-reduce per bucket, and the first launched
before backward reaches the first layer (observed at the moment the first layer's gradient is final),
every one asynchronous (a blocking all-reduce in the hook stalls backward)."""
import numpy as np

from ..comparing import compare, to_learner
from ..grading import Check, Mismatch
from ..harness import count_launches, run_ranks

TITLE = "DDP's gradient buckets and the hook that overlaps all-reduce with backward"
ORDER = 90
KIND = "implement"
NOTEBOOK = "03_data_parallel"
DEFINES = "BucketedDDP"
BATCH = 12
CAPS = (10 ** 9, 400, 200)       # float64 MLP below: 1, 3 and 4 buckets

STUB = '''"""Exercise ddp_buckets: DistributedDataParallel's gradient buckets and the hook that overlaps
communication with backward (Li et al. 2020, "PyTorch Distributed", sections 3.2 and 3.3).

Every rank holds the same model and runs forward and backward on its own share of the global
batch. Write the class BucketedDDP(module, comm, bucket_cap_bytes) so that

  - when loss.backward() returns, every trainable parameter's .grad holds the AVERAGE over the
    ranks of their gradients: every rank then has what one process computes on the whole batch;
    parameters with requires_grad False are left alone;
  - gradients travel in buckets: walk module.parameters() in reverse (backward finishes the last
    layer first), skip frozen ones, and start a new bucket when adding a parameter would make the
    bucket's gradients larger than bucket_cap_bytes (a bucket holds at least one parameter).
    Keep them as self.buckets, a list of lists of parameters, in that order;
  - communication overlaps backward: a bucket's all-reduce starts, asynchronously, the moment the
    last gradient of that bucket is final, while backward carries on with earlier layers; one
    all-reduce per bucket per backward;
  - ddp(x) returns module(x); the grader calls backward twice in a row (reset what must be reset).

What minitrain gives you:
  param.register_post_accumulate_grad_hook(hook)    hook(param) runs when param.grad is final
  minitrain.autograd.engine.queue_callback(fn)      fn() runs when the running backward finishes
  minitrain.comm.all_reduce(comm, flat, op="mean", async_op=True) returns a work;
      work.wait() returns the result (do not modify flat before that)

The test to pass: buckets for caps that give one and several buckets; at p = 1, 2, 3, 4 every
gradient equal to one process on the global batch (float64, 1e-12) twice in a row; one all-reduce
per bucket, the first launched before backward reaches the model's first layer.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check ddp_buckets mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check ddp_buckets mine.py
Stuck?     python -m minitrain.exercises hint ddp_buckets
"""
import numpy as np

from minitrain.autograd.engine import queue_callback
from minitrain.comm import all_reduce


class BucketedDDP:
    def __init__(self, module, comm, bucket_cap_bytes):
        raise NotImplementedError("BucketedDDP: build the buckets and register the hooks")

    def __call__(self, *args):
        return self.module(*args)
'''

HINTS = (
    "Three pieces. __init__: the buckets (reverse order, split at the cap) and, for each bucket, a "
    "flat buffer holding its gradients; a post-accumulate-grad hook on every trainable parameter. "
    "The hook: copy param.grad into its slot of its bucket's buffer; when the bucket has every "
    "gradient, launch its all-reduce. The end of backward: wait for every bucket and copy the "
    "averages back into each .grad.",
    "Keep, per parameter, (bucket index, start, end) of its slot, and per bucket the set of "
    "parameters already copied. In the hook, on the first gradient of a backward, register the "
    "end-of-backward function with queue_callback (once: a flag). Launch with "
    "work = all_reduce(comm, bucket_buffer, op='mean', async_op=True) and keep the work.",
    "The end-of-backward function: for each bucket, averaged = work.wait(); for each of its "
    "parameters p.grad[...] = averaged[start:end].reshape(p.shape); then clear each bucket's set "
    "of ready parameters and its work, and the flag, so that the next backward starts afresh. Use "
    "float64 buffers of the parameters' dtype (np.zeros(total, p.dtype)).",
)


def _model(freeze=True):
    import minitrain as mt
    from minitrain.nn import Linear, ReLU, Sequential
    mt.manual_seed(0)
    model = Sequential(Linear(4, 6), ReLU(), Linear(6, 6), ReLU(), Linear(6, 3))
    model.to(np.float64)
    if freeze:
        model[2].bias.requires_grad = False          # a frozen parameter: left out of the buckets
    return model


def _batch(step, rows=slice(None)):
    """Rows ``rows`` of step ``step``'s global batch (x, y), where the code under test runs."""
    rng = np.random.default_rng(step)
    x, y = rng.standard_normal((BATCH, 4)), rng.standard_normal((BATCH, 3))
    return to_learner(x[rows]), to_learner(y[rows])


def _expected_buckets(model, cap):
    buckets, current, size = [], [], 0
    for q in reversed(list(model.parameters())):
        if not q.requires_grad:
            continue
        if current and size + q.data.nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(q)
        size += q.data.nbytes
    buckets.append(current)
    return buckets


def _names(model, buckets):
    names = {id(q): n for n, q in model.named_parameters()}
    return [[names.get(id(q), "?") for q in b] for b in buckets]


def _buckets(comm, impl, cap):
    model = _model()
    ddp = impl(model, comm, cap)
    got = getattr(ddp, "buckets", None)
    want = _expected_buckets(model, cap)
    if not isinstance(got, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in got):
        raise Mismatch(f"bucket_cap_bytes={cap}: self.buckets is {type(got).__name__}, expected a list of lists "
                       "of parameters")
    if [[id(q) for q in b] for b in got] != [[id(q) for q in b] for b in want]:
        raise Mismatch(f"bucket_cap_bytes={cap}: buckets {_names(model, got)}, expected {_names(model, want)} "
                       "(reverse parameter order, frozen ones left out, a new bucket when the next gradient would "
                       "pass the cap)")


def _one_process(steps):
    from minitrain.nn import functional as F
    model = _model()
    grads = []
    for step in range(steps):
        model.zero_grad()
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        grads.append({n: None if q.grad is None else q.grad.copy() for n, q in model.named_parameters()})
    return grads


def _train(comm, impl, cap, steps):
    from minitrain.nn import functional as F
    model = _model()
    launched, seen = count_launches(comm), []
    # registered before the learner's hooks, so it runs first: "backward has reached the first layer"
    model[0].weight.register_post_accumulate_grad_hook(lambda q: seen.append(len(launched)))
    ddp = impl(model, comm, cap)
    share = BATCH // comm.size
    rows = slice(comm.rank * share, (comm.rank + 1) * share)
    grads, launches = [], []
    for step in range(steps):
        model.zero_grad()
        before = len(launched)
        x, y = _batch(step, rows)
        F.mse_loss(ddp(x), y).backward()
        grads.append({n: None if q.grad is None else q.grad.copy() for n, q in model.named_parameters()})
        asynchronous = sum(1 for _, is_async in launched[before:] if is_async)
        launches.append((len(launched) - before, (seen[-1] - before) if seen else None, asynchronous))
    return grads, launches, len(_expected_buckets(model, cap))


def _equal(impl, p):
    want = _one_process(2)
    for r, (grads, _, _) in enumerate(run_ranks(p, _train, impl, CAPS[2], 2)):
        for step in range(2):
            for name, g in want[step].items():
                got = grads[step][name]
                where = f"p={p}, rank {r}, backward #{step + 1}: {name}.grad"
                if g is None:
                    if got is not None:
                        raise Mismatch(f"{where} is set, but {name} is frozen (requires_grad=False): leave it out")
                    continue
                if got is None:
                    raise Mismatch(f"{where} is None; one process has a gradient there")
                problem = compare(got, g, where + " vs one process on the global batch", ranks=p)
                if problem:
                    raise Mismatch(problem + (" (the second backward differs: is something left over from the "
                                              "first?)" if step else ""))


def _overlap(impl, p):
    for r, (_, launches, buckets) in enumerate(run_ranks(p, _train, impl, CAPS[2], 2)):
        for step, (count, at_first_layer, asynchronous) in enumerate(launches):
            where = f"p={p}, rank {r}, backward #{step + 1}"
            if count != buckets:
                raise Mismatch(f"{where}: {count} collective(s) launched, expected one all-reduce per bucket "
                               f"({buckets} buckets at bucket_cap_bytes={CAPS[2]})")
            if not at_first_layer:
                raise Mismatch(f"{where}: no all-reduce had started when backward reached the first layer "
                               f"({buckets} buckets): launch a bucket from the hook as soon as its last gradient "
                               "is final, not at the end of backward")
            if asynchronous != buckets:
                raise Mismatch(f"{where}: {buckets - asynchronous} of {buckets} bucket all-reduces were blocking: "
                               "backward stops until each one is done, so nothing overlaps. Launch with "
                               "async_op=True and wait for the works at the end of backward")


def checks():
    out = [Check(f"buckets for bucket_cap_bytes={cap}: reverse order, frozen left out, split at the cap",
                 lambda f, cap=cap: run_ranks(1, _buckets, f, cap), 1) for cap in CAPS]
    for p in (1, 2, 3, 4):
        out.append(Check(f"p={p}: gradients equal one process on the global batch, twice in a row",
                         lambda f, p=p: _equal(f, p), 3))
        out.append(Check(f"p={p}: one all-reduce per bucket, launched during backward",
                         lambda f, p=p: _overlap(f, p), 2))
    return out


def reference():
    from minitrain.parallel import DistributedDataParallel

    class BucketedDDP:
        """minitrain's DistributedDataParallel, its buckets listed as lists of parameters."""

        def __init__(self, module, comm, bucket_cap_bytes):
            self.ddp = DistributedDataParallel(module, comm, bucket_cap_mb=bucket_cap_bytes / 2 ** 20)
            self.buckets = [list(b.params) for b in self.ddp.buckets]

        def __call__(self, *args):
            return self.ddp(*args)
    return BucketedDDP

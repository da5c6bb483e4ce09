"""Grader: the learner's loss and gradient from vocabulary-split logits against the cross-entropy
of the full logits (minitrain's F.cross_entropy, float64, 1e-12) at t = 1..4, with logits of size
1000 (no overflow), against minitrain's VocabParallelCrossEntropy, and the traffic: a few numbers
per row, never the logits (gathering them fails)."""
import numpy as np

from ..comparing import compare, to_learner
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "vocabulary-parallel cross-entropy (never gather the logits)"
ORDER = 150
KIND = "implement"
NOTEBOOK = "06_tensor_parallel"
DEFINES = "vocab_parallel_cross_entropy"
N, V = 5, 48

STUB = '''"""Exercise vocab_parallel_cross_entropy: the loss of a tensor-parallel language model
(Megatron-LM's vocabulary-parallel cross-entropy).

The LM head is column-parallel: rank r holds the logits of vocabulary columns [start, start + V/t)
for every row. Gathering (rows, V) logits would cost more than the whole rest of the step, so the
loss is computed from the shards, exchanging only a few numbers per row.

Write vocab_parallel_cross_entropy(comm, logits, targets, start):
  logits   this rank's (N, V/t) float64 columns [start, start + V/t) of the full (N, V) logits;
  targets  (N,) integer class indices in [0, V), the same on every rank;
Return (loss, grad_logits):
  loss         the mean over the N rows of -log softmax(full logits)[row, target], a Python float,
               the same on every rank;
  grad_logits  d loss / d logits for this rank's columns, (N, V/t).
It must work for logits of any size (1000 and more: exp(1000) overflows) and never send the logits.

Communicate with minitrain.comm.ring_all_reduce(comm, array, op="sum" or "max").

The test to pass: at t = 1, 2, 3, 4 the loss and the gradient equal minitrain's cross-entropy of
the full logits (float64, 1e-12), also with logits of size 1000, and minitrain's own
VocabParallelCrossEntropy; and the traffic stays below one rank's logits.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check vocab_parallel_cross_entropy mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check vocab_parallel_cross_entropy mine.py
Stuck?     python -m minitrain.exercises hint vocab_parallel_cross_entropy
"""
import numpy as np

from minitrain.comm import ring_all_reduce


def vocab_parallel_cross_entropy(comm, logits, targets, start):
    raise NotImplementedError("vocab_parallel_cross_entropy: return (loss, grad_logits)")
'''

HINTS = (
    "Per row, loss = log(sum over v of exp(z_v)) - z_target. Both pieces are reductions over the "
    "vocabulary, which is split over the ranks: each rank computes its part for every row, and an "
    "all-reduce of an (N,) array adds the parts. The target logit lives on one rank only: the others "
    "contribute 0 for that row.",
    "Overflow: exp(1000) is inf. Subtract the row's maximum M first (log sum exp(z) = M + log sum "
    "exp(z - M)), and it must be the same M on every rank, the maximum over the whole vocabulary: an "
    "all-reduce with op='max' of the local row maxima. Three all-reduces of (N,) numbers in all.",
    "With M, S = all-reduced sum of exp(z - M), and the target logit z_t: loss per row = log(S) + M - "
    "z_t; the loss is their mean. The gradient for this rank's columns is (exp(z - M) / S - onehot) / N, "
    "where onehot is 1 at (row, target - start) only if start <= target < start + V/t.",
)


def _data(scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((N, V)) * scale + (0 if scale == 1.0 else 500.0)
    targets = rng.integers(0, V, N)
    targets[0] = V - 1                       # the last rank's last column
    return logits, targets


def _full(logits, targets):
    import minitrain as mt
    from minitrain.nn import functional as F
    z = mt.Tensor(logits, requires_grad=True)
    loss = F.cross_entropy(z, to_learner(targets))
    loss.backward()
    return float(loss.data), z.grad


def _rank(comm, impl, scale):
    logits, targets = _data(scale)
    w = V // comm.size
    start = comm.rank * w
    mine = to_learner(logits[:, start:start + w])
    sent0 = comm.stats.bytes_sent
    value = impl(comm, mine, to_learner(targets), start)
    sent = comm.stats.bytes_sent - sent0
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise Mismatch(f"rank {comm.rank}: returned {type(value).__name__}, expected (loss, grad_logits)")
    return value[0], value[1], sent, mine.nbytes


def _check(impl, t, part):
    scale = 1000.0 if part == "large" else 1.0
    logits, targets = _data(scale)
    loss, grad = _full(logits, targets)
    w = V // t
    for r, (got_loss, got_grad, sent, shard_bytes) in enumerate(run_ranks(t, _rank, impl, scale)):
        where = f"t={t}, rank {r}" + (", logits around 500 +- 1000" if part == "large" else "")
        try:
            value = float(got_loss)
        except (TypeError, ValueError):
            raise Mismatch(f"{where}: the loss is {got_loss!r}, expected a number") from None
        if part in ("loss", "large") and not np.isclose(value, loss, rtol=1e-12, atol=1e-12):
            note = " (inf or NaN: did exp overflow?)" if not np.isfinite(value) else ""
            raise Mismatch(f"{where}: loss {value!r}, expected {loss!r} (the cross-entropy of the full logits){note}")
        if part in ("grad", "large"):
            problem = compare(got_grad, grad[:, r * w:(r + 1) * w], f"{where}: grad_logits (columns "
                              f"[{r * w}, {(r + 1) * w}))", rtol=1e-10, atol=1e-13)
            if problem:
                raise Mismatch(problem)
        if part == "traffic" and sent >= shard_bytes:
            raise Mismatch(f"{where}: sent {sent} bytes; this rank's logits are {shard_bytes} bytes. Exchange a few "
                           f"numbers per row (N = {N} rows), never the logits")


def checks():
    out = []
    for t in (1, 2, 3, 4):
        out += [Check(f"t={t}: the loss equals the full logits' cross-entropy", lambda f, t=t: _check(f, t, "loss"), 1),
                Check(f"t={t}: the gradient is this rank's columns of the full one", lambda f, t=t: _check(f, t, "grad"), 3),
                Check(f"t={t}: logits of size 1000: no overflow, same loss and gradient",
                      lambda f, t=t: _check(f, t, "large"), 2)]
        if t > 1:
            out.append(Check(f"t={t}: traffic: a few numbers per row, not the logits", lambda f, t=t: _check(f, t, "traffic"), 1))
    return out


def reference():
    import minitrain as mt
    from minitrain.parallel.tensor_parallel import VocabParallelCrossEntropy

    def vocab_parallel_cross_entropy(comm, logits, targets, start):
        z = mt.Tensor(logits, requires_grad=True)
        loss = VocabParallelCrossEntropy.apply(z, targets, comm, start, start + logits.shape[1] * (comm.size - comm.rank))
        loss.backward()
        return float(loss.data), z.grad
    return vocab_parallel_cross_entropy

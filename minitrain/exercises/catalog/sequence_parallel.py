"""Grader: a sequence-parallel MLP built with the learner's two operators (all-gather the sequence
shards, column- then row-parallel, reduce-scatter back to shards) must equal the unsplit MLP on
this rank's tokens (output, input gradient, weight gradients; float64, 1e-12) at t = 1..4, and
send what an all-gather plus a reduce-scatter send, no more (an all-reduce then a slice fails)."""
import numpy as np

from ..comparing import compare
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "sequence parallelism's all-gather / reduce-scatter operators"
ORDER = 160
KIND = "implement"
NOTEBOOK = "06_tensor_parallel"
DEFINES = ("GatherFromSequenceParallelRegion", "ReduceScatterToSequenceParallelRegion")
B, T, C, HIDDEN, OUT = 2, 12, 4, 12, 3

STUB = '''"""Exercise sequence_parallel: sequence parallelism's operators (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2).

Between the tensor-parallel regions (LayerNorm, dropout) Megatron's f and g keep the activation
whole on every rank. Sequence parallelism keeps it split along the sequence instead: rank r holds
tokens [r·T/t, (r+1)·T/t) of a (batch, T, channels) activation. Around a tensor-parallel MLP:

    y_r = RS(linear(relu(linear(AG(x_r), A_r)), B_r))

AG (replacing f) makes the whole sequence for the column-parallel layer; RS (replacing g) sums the
row-parallel layer's partial results and leaves each rank its own tokens.

Write the two autograd functions, called as AG.apply(x, comm) and RS.apply(x, comm), both along
axis 1 (the sequence) of a 3-D array:
  GatherFromSequenceParallelRegion (AG): forward (B, T/t, C) -> (B, T, C), the ranks' shards in
      rank order; backward: what the gradient of that needs to be;
  ReduceScatterToSequenceParallelRegion (RS): forward (B, T, C) -> (B, T/t, C): the sum over the
      ranks, this rank's tokens; backward: what the gradient of that needs to be.

minitrain's Function API: forward(ctx, x, comm) gets a NumPy array and returns one; backward(ctx,
grad) returns one gradient per forward input (None for comm). Communicate with
minitrain.comm.ring_all_gather(comm, flat_shard, total=...) and
minitrain.comm.ring_reduce_scatter(comm, flat_array) (both on 1-D arrays, chunks as np.array_split).

The test to pass: that MLP at t = 1, 2, 3, 4 against the unsplit MLP in float64 (this rank's rows of
the output and of dL/dX, and dL/dA_r, dL/dB_r, to 1e-12), and the traffic of one all-gather plus
one reduce-scatter each way (the bytes of the all-reduce they replace, not more).

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check sequence_parallel mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check sequence_parallel mine.py
Stuck?     python -m minitrain.exercises hint sequence_parallel
"""
import numpy as np

from minitrain.autograd import Function
from minitrain.comm import ring_all_gather, ring_reduce_scatter


class GatherFromSequenceParallelRegion(Function):        # AG
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("sequence_parallel: write the all-gather's forward and backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("sequence_parallel: write the all-gather's forward and backward")


class ReduceScatterToSequenceParallelRegion(Function):   # RS
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("sequence_parallel: write the reduce-scatter's forward and backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("sequence_parallel: write the reduce-scatter's forward and backward")
'''

HINTS = (
    "The two operators are each other's transpose. AG's forward copies every rank's shard to every "
    "rank; in backward each rank holds a gradient for the whole sequence, but only a partial one "
    "(from its columns of A), and its shard's true gradient is the sum of every rank's gradient for "
    "those tokens: a reduce-scatter. RS's backward is then an all-gather.",
    "The collectives work on flat arrays with chunks in rank order, so put the sequence axis first: "
    "front = np.ascontiguousarray(np.moveaxis(x, 1, 0)) has shape (T/t, B, C) and its flat form is "
    "rank r's chunk. Gather with ring_all_gather(comm, front.reshape(-1), total=front.size * t), "
    "reshape to (T, B, C) and move the axis back. Reduce-scatter the same way: move axis 1 to the "
    "front, flatten, ring_reduce_scatter, reshape to (T/t, B, C), move back.",
    "AG: forward = gather(x) (ctx.comm = comm), backward = (reduce_scatter(grad), None). RS: forward = "
    "reduce_scatter(x), backward = (gather(grad), None). Return contiguous arrays "
    "(np.ascontiguousarray) so that the next layer's matmuls and the collectives accept them.",
)


def _data():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(s) for s in ((B, T, C), (C, HIDDEN), (HIDDEN, OUT), (B, T, OUT)))


def _unsplit():
    import minitrain as mt
    x, A, Bw, dy = _data()
    xt, At, Bt = (mt.Tensor(a, requires_grad=True) for a in (x, A, Bw))
    y = (xt @ At).relu() @ Bt
    y.backward(dy)
    return y.data, xt.grad, At.grad, Bt.grad


def _rank(comm, impl):
    import minitrain as mt
    from minitrain.nn import functional as F
    ag, rs = impl
    x, A, Bw, dy = _data()
    t, r = comm.size, comm.rank
    n, s = HIDDEN // t, T // t
    xs = mt.Tensor(x[:, r * s:(r + 1) * s].copy(), requires_grad=True)
    a = mt.Tensor(A[:, r * n:(r + 1) * n].T.copy(), requires_grad=True)
    b = mt.Tensor(Bw[r * n:(r + 1) * n].T.copy(), requires_grad=True)
    sent0 = comm.stats.bytes_sent
    gathered = ag.apply(xs, comm)
    if tuple(gathered.shape) != (B, T, C):
        raise Mismatch(f"t={t}, rank {r}: GatherFromSequenceParallelRegion turned a {(B, s, C)} shard into "
                       f"{tuple(gathered.shape)}, expected {(B, T, C)}: gather along axis 1, the sequence")
    out = rs.apply(F.linear(F.linear(gathered, a).relu(), b), comm)
    forward_bytes = comm.stats.bytes_sent - sent0
    if tuple(out.shape) != (B, s, OUT):
        raise Mismatch(f"t={t}, rank {r}: the MLP's output has shape {tuple(out.shape)}, expected this rank's "
                       f"{s} tokens: {(B, s, OUT)}")
    out.backward(dy[:, r * s:(r + 1) * s].copy())
    backward_bytes = comm.stats.bytes_sent - sent0 - forward_bytes
    return (out.data, xs.grad, None if a.grad is None else a.grad.T, None if b.grad is None else b.grad.T,
            forward_bytes, backward_bytes)


def _check(impl, t, part):
    y, dx, dA, dB = _unsplit()
    n, s = HIDDEN // t, T // t
    for r, (out, gx, ga, gb, fwd, bwd) in enumerate(run_ranks(t, _rank, impl)):
        where, rows = f"t={t}, rank {r}", slice(r * s, (r + 1) * s)
        if part == "forward":
            problem = compare(out, y[:, rows], f"{where}: output for tokens [{r * s}, {(r + 1) * s})", ranks=t)
            if problem:
                raise Mismatch(problem + " (expected: the unsplit MLP's output on this rank's tokens)")
        elif part == "input":
            if gx is None:
                raise Mismatch(f"{where}: dL/dx_r is None: AG's backward must return a gradient for x")
            problem = compare(gx, dx[:, rows], f"{where}: dL/dx for tokens [{r * s}, {(r + 1) * s})", ranks=t)
            if problem:
                raise Mismatch(problem + " (each rank's backward sees a partial gradient of the whole sequence)")
        elif part == "weights":
            for name, got, want in (("dL/dA_r", ga, dA[:, r * n:(r + 1) * n]), ("dL/dB_r", gb, dB[r * n:(r + 1) * n])):
                if got is None:
                    raise Mismatch(f"{where}: {name} is None: no gradient reached the weights")
                problem = compare(got, want, f"{where}: {name}", ranks=t)
                if problem:
                    raise Mismatch(problem)
        elif part == "traffic" and t > 1:
            gather = (t - 1) * B * s * C * 8           # all-gather of x's shards
            scatter = (t - 1) * B * s * OUT * 8        # reduce-scatter of y
            back = (t - 1) * B * s * OUT * 8 + (t - 1) * B * s * C * 8
            if fwd > gather + scatter or bwd > back:
                raise Mismatch(f"{where}: sent {fwd} bytes in forward and {bwd} in backward; an all-gather of x plus a "
                               f"reduce-scatter of y send {gather + scatter} each way (the bytes of the one all-reduce "
                               "they replace). An all-reduce followed by a slice sends twice that")


def checks():
    out = []
    for t in (1, 2, 3, 4):
        out += [Check(f"t={t}: forward: this rank's tokens of the unsplit MLP's output", lambda f, t=t: _check(f, t, "forward"), 1),
                Check(f"t={t}: backward: dL/dx on this rank's tokens", lambda f, t=t: _check(f, t, "input"), 1),
                Check(f"t={t}: backward: dL/dA_r, dL/dB_r", lambda f, t=t: _check(f, t, "weights"), 3)]
        if t > 1:
            out.append(Check(f"t={t}: traffic: an all-gather and a reduce-scatter each way", lambda f, t=t: _check(f, t, "traffic"), 2))
    return out


def reference():
    from minitrain.parallel.tensor_parallel import GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion
    return GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion

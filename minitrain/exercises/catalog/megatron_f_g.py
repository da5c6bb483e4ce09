"""Grader: a column-then-row-parallel MLP built with the learner's f and g must equal the unsplit
MLP (output, input gradient, weight gradients; float64, 1e-12) at t = 1..4, and move exactly
Megatron's bytes: one all-reduce forward (g) and one backward (f)."""
import numpy as np

from ..comparing import compare
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "Megatron's f and g around a column/row-parallel MLP"
ORDER = 140
KIND = "implement"
NOTEBOOK = "06_tensor_parallel"
DEFINES = ("CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion")
HIDDEN = 12

STUB = '''"""Exercise megatron_f_g: Megatron's conjugate operators f and g (Shoeybi et al. 2019, section 3,
Figure 3), all the communication tensor parallelism needs.

A tensor-parallel MLP Y = ReLU(X A) B over t ranks: rank r holds a block of columns A_r of A and
the matching block of rows B_r of B, and computes ReLU(X A_r) B_r, one of t partial sums of Y:

    y = g(linear(relu(linear(f(x), A_r)), B_r))

Write the two autograd functions, f = CopyToTensorParallelRegion and g = ReduceFromTensorParallelRegion.
Each is called as f.apply(x, comm) and must make the tensor-parallel MLP compute exactly what the
unsplit one computes: the same Y on every rank, and in backward the full dL/dX on every rank.
Think about what each rank has and what it lacks, in forward and in backward.

minitrain's Function API: forward(ctx, x, comm) receives a NumPy array (x) and returns one;
backward(ctx, grad) receives dL/d(output) and returns one gradient per forward input (None for
comm). Keep what backward needs on ctx (ctx.comm = comm). Communicate with
minitrain.comm.ring_all_reduce(comm, array), which returns the sum over the ranks.

The test to pass: that MLP at t = 1, 2, 3, 4 against the unsplit MLP in float64 (output, dL/dX,
dL/dA_r and dL/dB_r, to 1e-12), and Megatron's traffic: one all-reduce in forward, one in backward.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check megatron_f_g mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check megatron_f_g mine.py
Stuck?     python -m minitrain.exercises hint megatron_f_g
"""
from minitrain.autograd import Function
from minitrain.comm import ring_all_reduce


class CopyToTensorParallelRegion(Function):       # f
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("megatron_f_g: write f's forward and backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("megatron_f_g: write f's forward and backward")


class ReduceFromTensorParallelRegion(Function):   # g
    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("megatron_f_g: write g's forward and backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("megatron_f_g: write g's forward and backward")
'''

HINTS = (
    "Forward: every rank has the whole X (replicated), so it can compute X A_r with no communication; "
    "but ReLU(X A_r) B_r is only one of t terms of Y. Backward: each rank's dL/dX = dL/dH_r A_r^T "
    "comes from its own columns only, so it is one of t terms of the full dL/dX.",
    "So one operator must sum over the ranks in forward (after the row-parallel layer) and the other "
    "in backward (before the column-parallel layer). Their other direction is the identity: the "
    "gradient of a sum with respect to each term is the incoming gradient itself, and the gradient "
    "of a copy is the sum of the copies' gradients.",
    "f: forward returns x (ctx.comm = comm first), backward returns (ring_all_reduce(ctx.comm, grad), "
    "None). g: forward returns ring_all_reduce(comm, x), backward returns (grad, None).",
)


def _data():
    rng = np.random.default_rng(0)
    x, A, B, dy = (rng.standard_normal(s) for s in ((5, 6), (6, HIDDEN), (HIDDEN, 3), (5, 3)))
    return x, A, B, dy


def _unsplit():
    import minitrain as mt
    x, A, B, dy = _data()
    xt, At, Bt = (mt.Tensor(a, requires_grad=True) for a in (x, A, B))
    y = (xt @ At).relu() @ Bt
    y.backward(dy)
    return y.data, xt.grad, At.grad, Bt.grad


def _rank(comm, impl):
    import minitrain as mt
    from minitrain.nn import functional as F
    f, g = impl
    x, A, B, dy = _data()
    n = HIDDEN // comm.size
    lo, hi = comm.rank * n, (comm.rank + 1) * n
    xs = mt.Tensor(x, requires_grad=True)
    a = mt.Tensor(A[:, lo:hi].T.copy(), requires_grad=True)     # Linear weights are (out, in)
    b = mt.Tensor(B[lo:hi].T.copy(), requires_grad=True)
    sent0 = comm.stats.bytes_sent
    out = g.apply(F.linear(F.linear(f.apply(xs, comm), a).relu(), b), comm)
    forward_bytes = comm.stats.bytes_sent - sent0
    out.backward(dy)
    backward_bytes = comm.stats.bytes_sent - sent0 - forward_bytes
    grads = (xs.grad, None if a.grad is None else a.grad.T, None if b.grad is None else b.grad.T)
    return out.data, *grads, forward_bytes, backward_bytes


def _check(impl, t, part):
    y, dx, dA, dB = _unsplit()
    results = run_ranks(t, _rank, impl)
    n = HIDDEN // t
    for r, (out, gx, ga, gb, fwd, bwd) in enumerate(results):
        where = f"t={t}, rank {r}"
        if part == "forward":
            problem = compare(out, y, f"{where}: the MLP's output Y", ranks=t)
            if problem:
                raise Mismatch(problem + " (each rank's ReLU(X A_r) B_r is one of t partial sums of Y)")
        elif part == "input":
            if gx is None:
                raise Mismatch(f"{where}: dL/dX is None: f's backward must return a gradient for x")
            problem = compare(gx, dx, f"{where}: dL/dX", ranks=t)
            if problem:
                raise Mismatch(problem + " (each rank's dL/dX comes from its columns of A only)")
        elif part == "weights":
            for name, got, want in (("dL/dA_r", ga, dA[:, r * n:(r + 1) * n]), ("dL/dB_r", gb, dB[r * n:(r + 1) * n])):
                if got is None:
                    raise Mismatch(f"{where}: {name} is None: no gradient reached the weights")
                problem = compare(got, want, f"{where}: {name}", ranks=t)
                if problem:
                    raise Mismatch(problem + " (compare with that slice of the unsplit MLP's gradient)")
        elif part == "traffic" and t > 1:
            one = 2 * (t - 1) * -(-y.size // t) * 8        # a ring all-reduce of Y (and of dX) per rank
            one_dx = 2 * (t - 1) * -(-dx.size // t) * 8
            if fwd > one or bwd > one_dx:
                raise Mismatch(f"{where}: sent {fwd} bytes in forward and {bwd} in backward; Megatron's f and g "
                               f"send one all-reduce each way: {one} bytes of Y forward, {one_dx} of dL/dX backward")


def checks():
    out = []
    for t in (1, 2, 3, 4):
        out += [Check(f"t={t}: forward: the output equals the unsplit MLP's", lambda f, t=t: _check(f, t, "forward"), 1),
                Check(f"t={t}: backward: dL/dX equals the unsplit MLP's", lambda f, t=t: _check(f, t, "input"), 2),
                Check(f"t={t}: backward: dL/dA_r, dL/dB_r are the slices of the unsplit gradients",
                      lambda f, t=t: _check(f, t, "weights"), 2)]
        if t > 1:
            out.append(Check(f"t={t}: traffic: one all-reduce forward, one backward", lambda f, t=t: _check(f, t, "traffic"), 2))
    return out


def reference():
    from minitrain.parallel.tensor_parallel import CopyToTensorParallelRegion, ReduceFromTensorParallelRegion
    return CopyToTensorParallelRegion, ReduceFromTensorParallelRegion

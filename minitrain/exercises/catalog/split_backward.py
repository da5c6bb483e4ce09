"""Grader: a Linear layer's backward cut in two (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
sec. 2, Figure 1), B (input gradient) and W (weight and bias gradients): each == the whole backward
(float64, 1e-12, x (6, 4) and (2, 3, 5)); B computes nothing from x, W nothing from the weight (watched
arrays); Ws in ZB-H1's order; minitrain's defer_weight_grads and a ZB-H1 pipeline running them."""
import numpy as np

from ..comparing import as_array, compare, host, to_learner
from ..grading import Check, Mismatch
from ..oracles import one_process_step, pipeline_matches_one_process, same_grads
from ..watching import Watched, watch

TITLE = "the backward split for zero-bubble pipelines: B (input gradient) now, W (weight gradient) later"
ORDER = 137
KIND = "implement"
NOTEBOOK = "05_pipeline"
DEFINES = ("backward_b", "backward_w")

STUB = '''"""Exercise split_backward: zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", sec. 2 and its Figure 1) cut a layer's backward in two. B computes the gradient of
the layer's input: the stage before waits for it, so it runs at once. W computes the gradients of
the layer's weights: nobody waits for them, so W runs later, in the holes of the schedule
(exercise zb_h1_schedule places it). minitrain's defer_weight_grads makes this split for every op.

Write both halves for a linear layer, y = x @ weight.T + bias (torch.nn.Linear's layout: weight
of shape (out, in), x of shape (..., in) with any leading dimensions, y of shape (..., out)):

  backward_b(grad_y, x, weight) -> (grad_x, deferred)
      B: grad_x, of x's shape, is dL/dx given grad_y = dL/dy; deferred is anything you like that
      holds what W will need;
  backward_w(deferred) -> (grad_weight, grad_bias)
      W: grad_weight of weight's shape (out, in) and grad_bias of shape (out,), for this call's
      micro-batch (every leading dimension of x is rows of one batch).

Contract:
  - B computes nothing from x (neither the weight gradient nor anything else: keep x for W) and
    not the bias gradient; W computes nothing from the weight (the input gradient was B's);
  - several Bs may run before the first W (each micro-batch its own deferred), and the Ws come
    in the order of their Bs, possibly interleaved with later Bs;
  - leave grad_y, x and weight as they are (the caller keeps them); return new arrays;
  - arrays live where the layer does (NumPy on the CPU, CuPy on the GPU): use
    xp = minitrain.backend.array_module(x), not np.

The test to pass:
  - B's grad_x and W's grad_weight and grad_bias == the whole backward's (float64, 1e-12), a
    square and a non-square weight, x of shape (6, 4) and (2, 3, 5);
  - B reads nothing of x but its shape, W nothing of the weight (the grader hands you watched
    NumPy arrays, on the GPU too);
  - four Bs and their Ws in the order of ZB-H1's stage 1: each W == its own micro-batch's;
  - minitrain's engine running your halves: an MLP under defer_weight_grads (three Bs, then
    w.run()) and a 2-stage ZB-H1 PipelineParallel == minitrain's own Linear.

Check it:  python -m minitrain.exercises check split_backward mine.py
Stuck?     python -m minitrain.exercises hint split_backward
"""


def backward_b(grad_y, x, weight):
    raise NotImplementedError("backward_b: the input gradient now, and what W will need")


def backward_w(deferred):
    raise NotImplementedError("backward_w: the weight and bias gradients from what B kept")
'''

HINTS = (
    "Write down which arrays each gradient reads. dL/dx needs grad_y and the weight; dL/dweight needs "
    "grad_y and x; dL/dbias needs grad_y alone. So B needs (grad_y, weight) and W needs (grad_y, x): that "
    "pair is the deferred. Keeping a reference costs nothing; it is why a micro-batch's activations stay "
    "in memory until its W, the memory the ZB papers count.",
    "Shapes tell the transposes. y = x @ weight.T, so grad_x = grad_y (..., out) @ weight (out, in): no "
    "transpose. grad_weight (out, in) sums, over every row of the batch, the outer product of that row's "
    "grad_y and x: fold the leading dimensions into rows first (reshape(-1, out) and reshape(-1, in)); "
    "grad_bias sums grad_y over every row, not only over the first axis.",
    "B: return grad_y @ weight, (grad_y, x). W: g = grad_y.reshape(-1, grad_y.shape[-1]); return "
    "g.T @ x.reshape(-1, x.shape[-1]), g.sum(axis=0). Nothing more in B: no copy of x, no sum of grad_y.",
)


def _node(saved, need):
    """What minitrain's engine hands an op's backward: the saved arrays, which inputs need a gradient."""
    return type("Node", (), {"saved_tensors": saved, "needs_input_grad": need})


def _whole(g, x, w):
    """The whole backward: minitrain's Linear asked for every gradient at once."""
    from ...autograd.ops.matmul import Linear
    return Linear.backward(_node((x, w), (True, True, True)), g)


def _values(rows, n_in, n_out, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(rows + (n_out,)), rng.standard_normal(rows + (n_in,)),
            rng.standard_normal((n_out, n_in)))


def _pair(out, name, what):
    if not (isinstance(out, tuple) and len(out) == 2):
        raise Mismatch(f"{what}: {name} returned {type(out).__name__} {out!r:.60}; return a pair, as the contract says")
    return out


def _expect(got, want, what, slips=()):
    """got == want (1e-12), or a Mismatch naming the slip (why, its result()) that explains what came out."""
    if got is None and what.endswith("grad_x"):
        raise Mismatch(f"{what} is None: B returns the input gradient at once (the stage before waits for it)")
    got = as_array(got, what)
    problem = compare(got, want, what, rtol=1e-12, atol=1e-12)
    if problem:
        for why, candidate in slips:           # each a slip's result, computed if its shapes allow
            try:
                c = candidate()
            except ValueError:
                continue
            if c.shape == got.shape and np.allclose(got, c, rtol=1e-12, atol=1e-12):
                raise Mismatch(f"{problem}: {why}")
        raise Mismatch(problem)


def _halves(impl, g, x, w, what):
    """B then W on the learner's copies; each result against the whole backward, the usual slips named."""
    mine = [to_learner(a) for a in (g, x, w)]
    grad_x, deferred = _pair(impl[0](*mine), "backward_b", what)
    grad_weight, grad_bias = _pair(impl[1](deferred), "backward_w", what)
    for name, given, before in zip(("grad_y", "x", "weight"), mine, (g, x, w)):
        if not np.array_equal(host(given), before):
            raise Mismatch(f"{what}: your code changed {name}; leave it as it is (the caller keeps it)")
    want = _whole(g, x, w)
    rows_g = g.reshape(-1, g.shape[-1])
    _expect(grad_x, want[0], f"{what}: grad_x", [
        ("you multiplied by weight.T; y = x @ weight.T, so grad_x = grad_y @ weight", lambda: g @ w.T),
        ("that is the weight gradient: B returns the input gradient, W the weight's", lambda: want[1])])
    _expect(grad_weight, want[1], f"{what}: grad_weight", [
        ("it is transposed: weight is (out, in), so grad_y.T @ x, not x.T @ grad_y", lambda: want[1].T),
        ("one matrix per leading index: fold every leading dimension into rows first",
         lambda: np.swapaxes(g, -1, -2) @ x)])
    _expect(grad_bias, want[2], f"{what}: grad_bias", [
        ("grad_y was not summed: one bias serves every row, so sum grad_y over all of them", lambda: g),
        ("summed over the first axis only: sum over every leading dimension (batch and sequence)", lambda: g.sum(axis=0)),
        ("averaged over the rows: sum them (the loss's 1/N is already in grad_y)", lambda: rows_g.mean(axis=0))])


def _split(impl):
    g, x, w = _values((2, 3), 5, 4, 2)
    Watched.seen = []
    try:
        Watched.half = "B"
        _, deferred = _pair(impl[0](watch(g, "grad_y"), watch(x, "x"), watch(w, "weight")), "backward_b", "B")
        Watched.half = "W"
        _pair(impl[1](deferred), "backward_w", "W")
    finally:
        Watched.half = None
    for half, name, op in Watched.seen:
        if half == "B" and name == "x":
            raise Mismatch(f"B ran {op} on x: the weight gradient (grad_y.T @ x) is W's work, which the pipeline "
                           f"defers; B keeps x for W (in deferred) and computes nothing from it")
        if half == "B" and name == "grad_y" and op.endswith(".reduce"):
            raise Mismatch(f"B ran {op} on grad_y: that is the bias gradient, a weight's gradient like the "
                           f"weight's: nobody waits for it, so it is W's work too")
        if half == "W" and name == "weight":
            raise Mismatch(f"W ran {op} on the weight: W needs only grad_y and x; the input gradient "
                           f"(grad_y @ weight) was B's, and the stage before has already received it")


def _in_zb_h1_order(impl):
    from ...parallel.pipeline import get_schedule
    order = [(a.kind, a.microbatch) for a in get_schedule("zb_h1", 3, 4)[1] if a.kind in "BW"]
    batches = [_values((3,), 5, 4, 10 + i) for i in range(4)]
    deferred, wants = {}, [_whole(*b) for b in batches]
    for kind, i in order:
        if kind == "B":
            _, deferred[i] = _pair(impl[0](*(to_learner(a) for a in batches[i])), "backward_b", f"B{i}")
            continue
        got = _pair(impl[1](deferred.pop(i)), "backward_w", f"W{i}")
        for k, name in ((1, "grad_weight"), (2, "grad_bias")):
            others = [(f"it is micro-batch {j}'s. Each B's deferred must hold its own micro-batch's arrays: a "
                       f"global, or a buffer reused, is overwritten by the next B before this W runs",
                       lambda j=j: wants[j][k]) for j in range(4) if j != i]
            _expect(got[k - 1], wants[i][k], f"order {' '.join(f'{a}{j}' for a, j in order)}: W{i}'s {name}", others)


def _linear_op(impl):
    """minitrain's Linear op, its backward the learner's: B and W as minitrain's engine asks for them."""
    from ...autograd.ops.matmul import Linear
    backward_b, backward_w = impl

    class YourLinear(Linear):
        @staticmethod
        def backward(ctx, g):
            x, weight = ctx.saved_tensors
            need, grad_x = ctx.needs_input_grad, None
            deferred = ctx.__dict__.pop("deferred", None)
            if need[0]:
                grad_x, deferred = backward_b(g, x, weight)
                if not any(need[1:]):              # B under defer_weight_grads: W comes later
                    ctx.deferred = deferred
                    return grad_x, None, None
            elif deferred is None:                 # nobody needs x's gradient (the first layer): no B ran
                _, deferred = backward_b(g, x, weight)
            grad_weight, grad_bias = backward_w(deferred)
            return grad_x, grad_weight, grad_bias
    return YourLinear


NOTE = " (minitrain's own Linear gives the expected one)"


def _mlp(op=None):
    from ... import manual_seed, nn
    manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    for layer in model if op is not None else ():
        if isinstance(layer, nn.Linear):
            layer.forward = (lambda q: lambda x: op.apply(x, q.weight, q.bias))(layer)
    return model.to(np.float64)


def _batch():
    return np.random.default_rng(3).standard_normal((12, 5)), np.random.default_rng(4).standard_normal((12, 3))


def _under_defer(impl):
    from ...autograd import Tensor, defer_weight_grads
    from ...nn import functional as F
    model, (x, y) = _mlp(_linear_op(impl)), _batch()
    losses = [F.mse_loss(model(Tensor(to_learner(x[i:i + 4]))), Tensor(to_learner(y[i:i + 4]))) / 3 for i in (0, 4, 8)]
    with defer_weight_grads(model.parameters()) as w:
        for loss in losses:
            loss.backward()                          # three Bs
    w.run()                                          # their Ws
    same_grads({n: host(q.grad) for n, q in model.named_parameters()}, one_process_step(_mlp, _batch())[1],
               "three Bs under defer_weight_grads, then W", NOTE)


def _pipeline(impl):
    pipeline_matches_one_process(2, "zb_h1", lambda: _mlp(_linear_op(impl)), _batch(), "ZB-H1 on 2 ranks, 4 micro-batches",
                                 reference=_mlp, note=NOTE)


def checks():
    return [Check("x (6, 4), weight (4, 4): B's grad_x, W's grad_weight and grad_bias == the whole backward",
                  lambda f: _halves(f, *_values((6,), 4, 4, 0), "x (6, 4), weight (4, 4)"), 2),
            Check("x (2, 3, 5), weight (4, 5): every leading dimension is rows of the batch",
                  lambda f: _halves(f, *_values((2, 3), 5, 4, 1), "x (2, 3, 5), weight (4, 5)"), 2),
            Check("B computes nothing from x (nor the bias gradient), W nothing from the weight", _split, 1),
            Check("four Bs and their Ws in ZB-H1's order: each W its own micro-batch's", _in_zb_h1_order, 1),
            Check("an MLP with your halves under minitrain's defer_weight_grads == one backward", _under_defer, 3),
            Check("a 2-stage ZB-H1 PipelineParallel with your halves == one process", _pipeline, 3)]


def reference():
    """minitrain's Linear backward, asked for the input gradient (B) and later for the weights' (W),
    as defer_weight_grads asks it: deferred is what its queue keeps, the incoming gradient and the saved x."""
    from ...autograd.ops.matmul import Linear

    def backward_b(grad_y, x, weight):
        grad_x, _, _ = Linear.backward(_node((x, weight), (True, False, False)), grad_y)
        return grad_x, (grad_y, x)

    def backward_w(deferred):
        grad_y, x = deferred
        _, grad_weight, grad_bias = Linear.backward(_node((x, None), (False, True, True)), grad_y)
        return grad_weight, grad_bias
    return backward_b, backward_w

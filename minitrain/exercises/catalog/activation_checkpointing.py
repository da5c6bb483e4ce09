"""Grader: a Linear-ReLU-Dropout-Linear block run through the learner's checkpoint against the plain
block (float64): the same output, bit-identical gradients of the input and of every parameter
(dropout included, so the recomputation must replay the random state), only the inputs saved for
backward (minitrain's memory tracker), exactly one extra forward, the random stream left where the
plain run leaves it, and equal to minitrain's own checkpoint."""
import numpy as np

from ..comparing import compare
from ..grading import Check, Mismatch

TITLE = "activation checkpointing: keep the inputs, recompute the rest in backward"
ORDER = 170
KIND = "implement"
NOTEBOOK = "07_recompute_offload"
DEFINES = "checkpoint"

STUB = '''"""Exercise activation_checkpointing: activation recomputation (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"), torch.utils.checkpoint.

Backward needs what forward computed (a Linear keeps its input, dropout its mask, ...). Checkpointing
a piece of the model keeps only the piece's inputs, and runs the piece again in backward to get the
rest: memory for compute.

Write checkpoint(fn, *args): fn takes Tensors (args) and returns one Tensor; it may use parameters
of its own (captured, not passed) and draw random numbers (dropout). checkpoint must
  - return a Tensor with the value of fn(*args);
  - keep nothing for backward but args: fn's intermediate activations are not stored;
  - in backward, run fn again, with gradients recorded and the same random numbers as the first
    time, and backpropagate the incoming gradient through it: args and fn's parameters get exactly
    the gradients the plain fn(*args) would give them;
  - leave the random stream where the plain run leaves it (random numbers drawn after forward and
    after backward must not change because of checkpointing).

What minitrain gives you: minitrain.autograd.Function (forward(ctx, *arrays, **options) receives
the Tensors' arrays; options such as fn=... pass through apply's keyword arguments; save arrays
with ctx.save_for_backward(...), read them with ctx.saved_tensors; backward(ctx, grad) returns one
gradient per positional input, None where none is needed; ctx.needs_input_grad says which);
minitrain.Tensor(array, requires_grad=...); out.backward(grad); minitrain.no_grad() and
minitrain.enable_grad(); minitrain.random.get_state() and set_state(state). The grader's args
always include one that requires grad.

The test to pass, on a Linear-ReLU-Dropout-Linear block in float64: the same output as the plain
block; bit-identical gradients of the input and of every parameter; only the inputs saved for
backward (minitrain's memory tracker); fn run exactly twice; the random stream unchanged; and
equal to minitrain's own checkpoint.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check activation_checkpointing mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check activation_checkpointing mine.py
Stuck?     python -m minitrain.exercises hint activation_checkpointing
"""
import minitrain as mt
from minitrain import random
from minitrain.autograd import Function


def checkpoint(fn, *args):
    raise NotImplementedError("checkpoint: run fn without a graph now, again with one in backward")
'''

HINTS = (
    "Write a Function subclass, called as YourFunction.apply(*args, fn=fn). Its forward gets the "
    "args' arrays: save them (ctx.save_for_backward(*arrays)), and run fn on Tensors made from them "
    "under mt.no_grad(), so that no graph (and no activation) is recorded; return the output's "
    ".data. Keep fn on ctx.",
    "The random numbers: remember random.get_state() in forward, before running fn. In backward, save "
    "the current state, set the remembered one, rerun fn, then set the saved state back: dropout draws "
    "the same mask, and the random stream continues as if nothing had been replayed.",
    "backward(ctx, grad): leaves = [mt.Tensor(a, requires_grad=need) for a, need in "
    "zip(ctx.saved_tensors, ctx.needs_input_grad)]; with mt.enable_grad(): out = ctx.fn(*leaves); "
    "out.backward(grad) (this also fills fn's parameters' .grad); return tuple(leaf.grad if need "
    "else None for ...).",
)


def _block(seed=0):
    import minitrain as mt
    from minitrain.nn import Dropout, Linear, ReLU, Sequential
    mt.manual_seed(seed)
    block = Sequential(Linear(6, 16), ReLU(), Dropout(0.3), Linear(16, 6))
    block.to(np.float64)
    return block


def _run(impl, use_checkpoint, seed=0):
    """Forward and backward of the block (checkpointed or not) in a fresh memory tracker; returns what
    the checks compare."""
    import minitrain as mt
    from minitrain import memory, random
    tracker = memory.MemoryTracker()
    calls = []
    with memory.use_tracker(tracker):
        block = _block(seed)
        rng = np.random.default_rng(seed)
        x = mt.Tensor(rng.standard_normal((5, 6)), requires_grad=True)
        g = rng.standard_normal((5, 6))

        def fn(h):
            calls.append(1)
            return block(h)
        mt.manual_seed(100 + seed)
        tracker.reset_peak()
        before = tracker.snapshot()["activations"]
        out = impl(fn, x) if use_checkpoint else fn(x)
        if not isinstance(out, mt.Tensor):
            raise Mismatch(f"checkpoint(fn, x) returned {type(out).__name__}, expected a minitrain Tensor")
        saved = tracker.snapshot()["activations"] - before
        random.rand(3)                          # something else draws between forward and backward
        calls_forward = len(calls)
        out.backward(g)
        after = random.rand(4)                  # the stream after backward
    grads = {"x": x.grad, **{n: q.grad for n, q in block.named_parameters()}}
    return {"out": out.data.copy(), "grads": grads, "saved": saved, "input_bytes": x.data.nbytes,
            "calls": (calls_forward, len(calls)), "after": after}


def _check(impl, part):
    plain, mine = _run(None, False), _run(impl, True)
    if part == "output":
        problem = compare(mine["out"], plain["out"], "checkpoint(block, x)'s output vs block(x)", exact=True)
        if problem:
            raise Mismatch(problem)
    elif part == "grads":
        for name, want in plain["grads"].items():
            got = mine["grads"][name]
            if got is None:
                raise Mismatch(f"the gradient of {name} is None after backward through checkpoint: the recomputed "
                               "graph must be backpropagated (out.backward(grad)) and its grads returned")
            problem = compare(got, want, f"the gradient of {name} vs the plain block", exact=True)
            if problem:
                raise Mismatch(problem + " (dropout: does the recomputation draw the forward's mask?)")
    elif part == "memory":
        if mine["saved"] > mine["input_bytes"]:
            raise Mismatch(f"checkpoint kept {mine['saved']} bytes for backward after forward; the input is "
                           f"{mine['input_bytes']} bytes (the plain block keeps {plain['saved']}). Run fn under "
                           "no_grad in forward and save only the inputs")
    elif part == "calls":
        forward, total = mine["calls"]
        if (forward, total) != (1, 2):
            raise Mismatch(f"fn ran {forward} time(s) during forward and {total - forward} during backward; "
                           "checkpointing runs it once in each")
    elif part == "random":
        problem = compare(mine["after"], plain["after"], "random numbers drawn after backward vs the plain run",
                          exact=True)
        if problem:
            raise Mismatch(problem + ": restore the random state after replaying fn (set_state back to what "
                           "it was when backward began)")
    elif part == "library":
        from minitrain.parallel import checkpoint as library
        theirs = _run(library, True)
        for name, want in theirs["grads"].items():
            problem = compare(mine["grads"][name], want, f"the gradient of {name} vs minitrain's checkpoint",
                              exact=True)
            if problem:
                raise Mismatch(problem)


def checks():
    return [Check("forward: the same output as the plain block", lambda f: _check(f, "output"), 1),
            Check("backward: bit-identical gradients of x and of every parameter (dropout included)",
                  lambda f: _check(f, "grads"), 2),
            Check("memory: only the inputs are kept for backward", lambda f: _check(f, "memory"), 1),
            Check("compute: fn runs once in forward and once more in backward", lambda f: _check(f, "calls"), 1),
            Check("the random stream continues as without checkpointing", lambda f: _check(f, "random"), 2),
            Check("equal to minitrain's own checkpoint", lambda f: _check(f, "library"), 3)]


def reference():
    from minitrain.parallel import checkpoint
    return checkpoint

"""Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

checkpoint(fn, *args) runs fn without recording its graph, so none of its intermediate
activations are kept: only its inputs are saved. In backward, fn runs again, this time
recording, from the saved inputs and with the random state it had the first time (a dropout
inside draws the same mask), and the gradient flows back through that fresh graph. Memory: the
inputs instead of every intermediate. Cost: one more forward of fn. Gradients are
bit-identical to the plain run. (Lives in autograd, as torch.utils.checkpoint does, so that
models in nn/ can use it; parallel/recompute.py adds checkpoint_sequential.)

A parameter used inside fn gets its gradient from the inner backward; its
post-accumulate-grad hook fires there, as in PyTorch's reentrant checkpoint.
"""
from .. import random
from ..backend import array_module
from .function import Function
from .grad_mode import enable_grad, is_grad_enabled, no_grad
from .graph import no_saved_tensors_hooks
from .tensor import Tensor


class _Checkpoint(Function):
    keeps_input_dtype = False        # the output has the dtype fn's own ops gave it (e.g. logits cast to fp32)

    @staticmethod
    def forward(ctx, _anchor, *arrays, fn=None, kwargs=None):
        ctx.fn, ctx.kwargs = fn, kwargs or {}
        ctx.rng_state = random.get_state()
        ctx.save_for_backward(*arrays)            # the only activations kept: fn's inputs
        with no_grad():
            out = fn(*[Tensor._wrap(a) for a in arrays], **ctx.kwargs)
        return out.data

    @staticmethod
    def backward(ctx, grad):
        arrays = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        leaves = []
        for a, needed in zip(arrays, needs):
            leaf = Tensor._wrap(a)
            leaf._requires_grad = needed
            leaves.append(leaf)
        now = random.get_state()
        random.set_state(ctx.rng_state)          # replay fn's random draws (dropout masks)
        try:
            with enable_grad(), no_saved_tensors_hooks():     # kept on the device for this backward (graph.py)
                out = ctx.fn(*leaves, **ctx.kwargs)
        finally:
            random.set_state(now)
        if out.requires_grad:
            out.backward(grad)
        return (None,) + tuple(leaf.grad if needed else None for leaf, needed in zip(leaves, needs))


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (tensor arguments; one tensor out), recomputed in backward instead of stored."""
    if not all(isinstance(a, Tensor) for a in args):
        raise TypeError("checkpoint: positional arguments must be Tensors (pass options as keywords)")
    # an empty tensor that requires grad makes sure the node is recorded even when no input needs a
    # gradient (the first layer's input): the parameters inside fn still need their backward
    anchor = Tensor._wrap(array_module(args[0].data).zeros(0, dtype=args[0].dtype))
    anchor._requires_grad = is_grad_enabled()
    return _Checkpoint.apply(anchor, *args, fn=fn, kwargs=kwargs)

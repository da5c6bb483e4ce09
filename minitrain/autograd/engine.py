"""backward(): reverse-mode differentiation over the recorded graph.

1. Walk the graph from the output (iteratively: a GPT's graph is deep) to collect the nodes and
   count, for each leaf, how many edges feed it.
2. Run the nodes newest first. A node is always created after its inputs, so newest-first is a
   topological order, and it matches PyTorch's order: the last layer's gradients are final first,
   which is what lets DDP start communicating early.
3. Each node's backward turns the gradient of its output into gradients of its inputs; gradients
   that meet at a tensor are summed. When a leaf has received all its contributions it is
   accumulated into leaf.grad (in place when a gradient is already there) and its
   post-accumulate-grad hooks fire: "this parameter's gradient is final".
4. Unless retain_graph=True, each node frees its saved arrays as soon as it has run.

5. Inside defer_weight_grads(weights) (deferred.py), a node with one of those weights among its
   inputs computes only its other inputs' gradients now (B) and is queued, saved arrays kept, for
   the weights' gradients later (W): zero-bubble pipelines. Otherwise nothing changes.

6. Callbacks queued during this backward (queue_callback, as PyTorch's engine has) run at its
   end: DDP uses one to launch the buckets that are still open and to wait for every reduction, so
   that gradients are synchronised when backward() returns.

Ownership: an array that a backward returns freshly (not its incoming gradient, not a view) is
owned by the engine, which may then add into it in place; anything else is copied before it is
written to. This keeps accumulation allocation-free without aliasing bugs. NumPy returns a scalar,
not an array, for arithmetic on 0-d arrays; a scalar cannot be added into in place, so each is made
a fresh 0-d array first (else the second gradient into a 0-d tensor used twice would be dropped).
"""


def _owned(g, grad_out, others):
    if g is grad_out or g.base is not None:
        return False
    for o in others:
        if o is g:
            return False
    return True


def _add(entry, g, owned):
    """Sum a new contribution ``g`` into ``entry`` = [array, owned]."""
    acc = entry[0]
    if entry[1] and acc.shape == g.shape:
        acc += g
    else:
        entry[0] = acc + g
        entry[1] = True


import threading

import numpy as np

from ..backend import array_module, is_device_array, to_device
from . import deferred as _deferred
from .function import Function


class _Callbacks(threading.local):
    def __init__(self):
        self.queue = None      # a list while a backward is running on this thread
        self.depth = 0         # backward inside backward: activation recomputation


_callbacks = _Callbacks()


def queue_callback(fn):
    """Run ``fn()`` when the outermost backward running on this thread has finished (a backward
    nested inside it, as recomputation runs, does not count: its end is not the end of the step)."""
    if _callbacks.queue is None:
        raise RuntimeError("queue_callback() can only be called while backward() is running")
    _callbacks.queue.append(fn)


def in_backward():
    """Is a backward running on this thread? (A forward now is a recomputation: activation checkpointing.)"""
    return _callbacks.queue is not None


def backward(root, grad=None, retain_graph=False):
    """Accumulate the gradient of ``root`` into every leaf it depends on (see the module docstring)."""
    outermost = _callbacks.depth == 0
    if outermost:
        _callbacks.queue = []
    _callbacks.depth += 1
    try:
        _backward(root, grad, retain_graph)
        while outermost and _callbacks.queue:    # a callback may queue another
            _callbacks.queue.pop(0)()
    finally:
        _callbacks.depth -= 1
        if outermost:
            _callbacks.queue = None


def _root_gradient(root, grad):
    """The gradient backward starts from, as an array: ``grad``, or 1 for a scalar root; checked."""
    from .tensor import Tensor  # local import: tensor.py imports this module

    xp_grad = grad._data if isinstance(grad, Tensor) else grad
    if xp_grad is not None and is_device_array(root._data) and not is_device_array(xp_grad):
        xp_grad = to_device(xp_grad)           # a host gradient for a GPU output: copied on purpose (counted)
    if xp_grad is None:
        if root._data.size != 1:
            raise RuntimeError(
                f"backward() on a tensor of shape {root.shape} needs grad=: the gradient of the "
                "loss w.r.t. this tensor (only a scalar output gets an implicit grad of 1)")
        xp_grad = array_module(root._data).ones_like(root._data)
    elif xp_grad.shape != root._data.shape:
        raise ValueError(f"backward(): grad has shape {xp_grad.shape}, the tensor has {root.shape}")
    if not root.requires_grad:
        raise RuntimeError("backward() on a tensor that does not require grad (no graph was recorded)")
    return xp_grad


def _backward(root, grad, retain_graph):
    from .tensor import Tensor  # local import: tensor.py imports this module

    xp_grad = _root_gradient(root, grad)
    if root._ctx is None:  # the root is itself a leaf
        _accumulate_leaf(root, xp_grad, False)
        return

    # 1. collect the nodes reachable from the root; count the edges into each leaf
    nodes = []
    seen = {id(root._ctx)}
    stack = [root._ctx]
    leaf_pending = {}
    while stack:
        node = stack.pop()
        nodes.append(node)
        for parent in node.parents:     # None, a producing node, or a leaf tensor
            if parent is None:
                continue
            if not isinstance(parent, Function):
                leaf_pending[id(parent)] = leaf_pending.get(id(parent), 0) + 1
            elif id(parent) not in seen:
                seen.add(id(parent))
                stack.append(parent)
    nodes.sort(key=_seq, reverse=True)

    # 2-5. newest first
    weights = _deferred.active()          # None: an ordinary backward
    grads = {id(root._ctx): [xp_grad, False]}
    leaf_grads = {}
    for node in nodes:
        entry = grads.pop(id(node), None)
        in_grads = ()
        deferred = None
        if entry is not None:
            g = entry[0]
            if node._tensor_hooks:
                for hook in node._tensor_hooks:
                    result = hook(Tensor(g))
                    if result is not None:
                        g = result._data if isinstance(result, Tensor) else result
                        entry[1] = False
            if weights is not None:       # B now; W (and freeing the saved arrays) in weights.run()
                deferred = in_grads = weights.input_grads(node, g, retain_graph)
            if deferred is None:
                in_grads = node.backward(node, g)
            if type(in_grads) is not tuple:
                in_grads = (in_grads,)
        if not retain_graph and deferred is None:
            node.release_saved()
        for i, parent in enumerate(node.parents):
            if parent is None:
                continue
            gi = in_grads[i] if i < len(in_grads) else None
            is_node = isinstance(parent, Function)
            if gi is not None:
                if isinstance(gi, np.generic):
                    gi = np.array(gi)
                owned = _owned(gi, entry[0], in_grads[:i] + in_grads[i + 1:])
                table = grads if is_node else leaf_grads
                acc = table.get(id(parent))
                if acc is None:
                    table[id(parent)] = [gi, owned]
                else:
                    _add(acc, gi, owned)
            if not is_node:
                left = leaf_pending[id(parent)] - 1
                leaf_pending[id(parent)] = left
                if left == 0:
                    acc = leaf_grads.pop(id(parent), None)
                    if acc is not None:
                        _accumulate_leaf(parent, acc[0], acc[1])


def _seq(node):
    return node.seq


def _accumulate_leaf(leaf, g, owned):
    if leaf._hooks:
        for hook in leaf._hooks:
            result = hook(type(leaf)._wrap(g))
            if result is not None:
                g = result._data if hasattr(result, "_data") else result
                owned = False
    if g.shape != leaf._data.shape:
        raise RuntimeError(f"gradient of shape {g.shape} for a leaf of shape {leaf._data.shape}")
    if g.dtype != leaf._data.dtype:          # a leaf's gradient has the leaf's dtype (as in PyTorch)
        g, owned = g.astype(leaf._data.dtype), True
    if leaf._grad is None:
        leaf.grad = g if owned else g.copy()
    else:
        leaf._grad += g
    if leaf._post_acc_hooks:
        for hook in leaf._post_acc_hooks:
            hook(leaf)

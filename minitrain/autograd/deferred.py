"""Backward split in two: B (gradients of the inputs) now, W (gradients of the weights) later.

Zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 2) need the two
halves of a layer's backward as separate pieces of work: B is on the critical path (the previous
stage waits for the input gradient), W is not and can fill the pipeline's idle time. Inside

    with defer_weight_grads(stage.parameters()) as w:    # B
        out.backward(grad)                                # input gradients only
    ...
    w.run()                                               # W: the weights' .grad, later

every graph node with one of the given weights among its inputs runs its backward with
needs_input_grad cleared for those weights (Linear computes g @ W but not g^T x), and is
queued, with its incoming gradient and its saved arrays, for run(), which calls the same
backward again for the weights alone and accumulates into .grad (hooks fire then, once per
weight). Cost: no extra FLOPs for ops that honour needs_input_grad; the saved arrays of the
queued nodes (a layer's input) and their incoming gradients live until W, which is the
activation memory the ZB papers count until W. Outside the block the engine is unchanged.
"""
import threading

from .function import Function


class _Active(threading.local):
    queue = None          # the WeightGradients of the innermost defer_weight_grads() block


_active = _Active()


def active():
    """The WeightGradients collecting deferred work on this thread, or None (ordinary backward)."""
    return _active.queue


class WeightGradients:
    """The W half of one or more backwards: nodes whose weights' gradients are still to compute."""

    def __init__(self, weights):
        self.weight_ids = {id(w) for w in weights}
        self.retain_graph = False
        self._queue = []              # (node, incoming gradient, positions of its weight inputs)

    def __len__(self):
        return len(self._queue)

    def _weight_positions(self, node):
        return tuple(i for i, p in enumerate(node.parents)
                     if p is not None and not isinstance(p, Function) and id(p) in self.weight_ids)

    def input_grads(self, node, grad, retain_graph):
        """B for one node (called by the engine): its backward without the weights' gradients,
        or None when the node has no weight input (the engine then runs it as usual)."""
        positions = self._weight_positions(node)
        if not positions:
            return None
        self.retain_graph = self.retain_graph or retain_graph
        self._queue.append((node, grad, positions))
        full = node.needs_input_grad
        rest = tuple(need and i not in positions for i, need in enumerate(full))
        if not any(rest):
            return ()                              # only weights need a gradient: all of it is W
        node.needs_input_grad = rest
        try:
            grads = node.backward(node, grad)
        finally:
            node.needs_input_grad = full
        grads = grads if type(grads) is tuple else (grads,)
        return tuple(None if i in positions else g for i, g in enumerate(grads))

    def run(self):
        """W: compute every queued weight gradient, sum the contributions per weight and
        accumulate each into its .grad (post-accumulate hooks fire here). Empties the queue."""
        from .engine import _accumulate_leaf, _add, _owned
        remaining = {}                             # weight -> contributions still to come
        for node, _, positions in self._queue:
            for i in positions:
                key = id(node.parents[i])
                remaining[key] = remaining.get(key, 0) + 1
        sums = {}
        queue, self._queue = self._queue, []
        for node, grad, positions in queue:
            full = node.needs_input_grad
            node.needs_input_grad = tuple(i in positions for i in range(len(full)))
            try:
                grads = node.backward(node, grad)
            finally:
                node.needs_input_grad = full
            if not self.retain_graph:
                node.release_saved()
            grads = grads if type(grads) is tuple else (grads,)
            for i in positions:
                leaf = node.parents[i]
                g = grads[i] if i < len(grads) else None
                if g is not None:
                    owned = _owned(g, grad, grads[:i] + grads[i + 1:])
                    acc = sums.get(id(leaf))
                    if acc is None:
                        sums[id(leaf)] = [g, owned]
                    else:
                        _add(acc, g, owned)
                remaining[id(leaf)] -= 1
                if remaining[id(leaf)] == 0:
                    acc = sums.pop(id(leaf), None)
                    if acc is not None:
                        _accumulate_leaf(leaf, acc[0], acc[1])


class defer_weight_grads:
    """with defer_weight_grads(weights) as w:: backwards inside compute input gradients only
    and queue the gradients of weights into w; w.run() computes them (see the module
    docstring). Blocks nest; the innermost one collects."""

    def __init__(self, weights):
        self.weights = WeightGradients(weights)

    def __enter__(self):
        self._previous = _active.queue
        _active.queue = self.weights
        return self.weights

    def __exit__(self, *exc):
        _active.queue = self._previous
        return False

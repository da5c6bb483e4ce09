"""Hooks on tensors, as PyTorch's: Tensor.register_hook (the gradient w.r.t. a tensor, seen or
replaced as it is computed) and register_post_accumulate_grad_hook (a leaf's .grad, once
final), and RemovableHandle, which every register_*_hook returns (a Module's too). The hooks
are kept on the leaf or on the node that made the tensor; engine.py calls them."""


class RemovableHandle:
    """Returned by every register_*_hook; ``remove()`` takes the hook out again."""

    def __init__(self, hooks, hook):
        self._hooks, self._hook = hooks, hook

    def remove(self):
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class TensorHooks:
    """Tensor's register_*_hook methods (Tensor inherits them; the lists live in its slots)."""
    __slots__ = ()

    def register_hook(self, fn):
        """``fn(grad) -> None or new grad``, called when the gradient w.r.t. this tensor is computed."""
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that does not require grad")
        if self._ctx is None:
            if self._hooks is None:
                self._hooks = []
            hooks = self._hooks
        else:
            if self._ctx._tensor_hooks is None:
                self._ctx._tensor_hooks = []
            hooks = self._ctx._tensor_hooks
        hooks.append(fn)
        return RemovableHandle(hooks, fn)

    def register_post_accumulate_grad_hook(self, fn):
        """``fn(tensor)``, called once per backward after this leaf's ``.grad`` is final."""
        if self._ctx is not None:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf tensors")
        if self._post_acc_hooks is None:
            self._post_acc_hooks = []
        self._post_acc_hooks.append(fn)
        return RemovableHandle(self._post_acc_hooks, fn)


def check_grad(tensor, grad):
    """What ``.grad`` accepts: the tensor's shape (PyTorch: "assigned grad has data of a different size"); a (1,)
    gradient would broadcast into every update, silently."""
    if grad is not None and tuple(grad.shape) != tuple(tensor.shape):
        raise ValueError(f"assigned grad has shape {tuple(grad.shape)}, the tensor {tuple(tensor.shape)}")
    return grad

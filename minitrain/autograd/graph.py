"""Saved-tensor hooks, as torch.autograd.graph.saved_tensors_hooks.

Inside with saved_tensors_hooks(pack, unpack): every array an operation saves for backward
is replaced by pack(array); backward calls unpack(packed) to get it back. Activation
offload (pack = copy to host), memory accounting and recomputation are built on this.
Unlike PyTorch, pack and unpack see raw xp arrays, not tensors: minitrain's Functions save arrays.
"""
import threading


class _HookStack(threading.local):
    def __init__(self):
        self.stack = []


_hooks = _HookStack()


def current_saved_tensors_hooks():
    """The innermost (pack, unpack) pair, or None."""
    stack = _hooks.stack
    return stack[-1] if stack else None


class saved_tensors_hooks:
    def __init__(self, pack_hook, unpack_hook):
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook

    def __enter__(self):
        _hooks.stack.append((self.pack_hook, self.unpack_hook))
        return self

    def __exit__(self, *exc):
        _hooks.stack.pop()
        return False

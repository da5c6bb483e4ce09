"""Saved-tensor hooks, as torch.autograd.graph.saved_tensors_hooks.

Inside with saved_tensors_hooks(pack, unpack): every array an operation saves for backward
is replaced by pack(array); backward calls unpack(packed) to get it back. Activation
offload (pack = copy to host), memory accounting and recomputation are built on this.
Unlike PyTorch, pack and unpack see raw xp arrays, not tensors: minitrain's Functions save arrays.
A recomputation (checkpoint's backward) runs with no hooks at all: what it saves is needed on the device
at once, by the backward that asked for it, so an outer offload must not move it away and back (as in
PyTorch, whose checkpoint keeps what its recomputation saves itself).
"""
import contextlib
import threading


class _HookStack(threading.local):
    def __init__(self):
        self.stack = []


_hooks = _HookStack()


def current_saved_tensors_hooks():
    """The innermost (pack, unpack) pair, or None."""
    stack = _hooks.stack
    return stack[-1] if stack else None


@contextlib.contextmanager
def no_saved_tensors_hooks():
    """No hooks inside (those outside come back after): checkpoint's recomputation."""
    outer, _hooks.stack = _hooks.stack, []
    try:
        yield
    finally:
        _hooks.stack = outer


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

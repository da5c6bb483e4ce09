"""Module and Parameter, with PyTorch's names and call shapes.

A Module registers the Parameters and sub-Modules assigned to its attributes, in assignment
order; named_parameters() walks them depth-first with dotted names (h.0.attn.c_attn.weight),
listing a shared (tied) Parameter once. Strategies wrap modules from outside through hooks
(register_forward_pre_hook / register_forward_hook); a model never knows how it is run.
Parameters register their bytes (and their gradients') with minitrain.memory.
"""
import weakref
from collections import OrderedDict

from .. import backend, memory
from ..autograd import Tensor, RemovableHandle
from ..autograd.hooks import check_grad


def _release(mem):
    tracker, pkey, gkey = mem[:3]
    if pkey is not None:
        tracker.remove(pkey)
    if gkey is not None:
        tracker.remove(gkey)


class Parameter(Tensor):
    """A leaf tensor that a Module owns and an optimizer updates (requires_grad by default)."""

    __slots__ = ("_mem",)

    def __init__(self, data, requires_grad=True):
        super().__init__(data.data if isinstance(data, Tensor) else data, requires_grad=requires_grad)
        tracker = memory.tracker()
        # tracker, key of data, key of grad, on the host (made inside memory.on_host(): offloaded)
        self._mem = [tracker, None, None, tracker.placing_on_host]
        self._track_data()
        weakref.finalize(self, _release, self._mem)

    def _track_data(self):
        tracker = self._mem[0]
        if self._mem[1] is not None:
            tracker.remove(self._mem[1])
        base = memory.owner(self._data)
        key = ("params", id(base))
        tracker.add("params", key, base.nbytes, host=self._mem[3])
        self._mem[1] = key

    @Tensor.data.setter
    def data(self, value):
        self._data = value._data if isinstance(value, Tensor) else value
        self._track_data()

    @Tensor.grad.setter
    def grad(self, value):
        value = check_grad(self, value._data if isinstance(value, Tensor) else value)
        tracker = self._mem[0]
        if self._mem[2] is not None:
            tracker.remove(self._mem[2])
            self._mem[2] = None
        self._grad = value
        if value is not None:
            # keyed by the buffer that owns the memory: gradients that are views of one flat buffer
            # (ZeRO, FSDP) count once, as parameters do
            base = memory.owner(value)
            key = ("grads", id(base))
            tracker.add("grads", key, base.nbytes, host=self._mem[3])
            self._mem[2] = key

    def __repr__(self):
        return f"Parameter({self._data!r})"


class Module:
    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", [])
        object.__setattr__(self, "_forward_hooks", [])
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        object.__delattr__(self, name)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        if self._forward_pre_hooks:
            for hook in list(self._forward_pre_hooks):
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        out = self.forward(*args, **kwargs)
        if self._forward_hooks:
            for hook in list(self._forward_hooks):
                result = hook(self, args, out)
                if result is not None:
                    out = result
        return out

    def register_forward_pre_hook(self, hook):
        """``hook(module, args) -> None or new args``, before forward (ZeRO-3 gathers a unit here)."""
        self._forward_pre_hooks.append(hook)
        return RemovableHandle(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook):
        """``hook(module, args, output) -> None or new output``, after forward."""
        self._forward_hooks.append(hook)
        return RemovableHandle(self._forward_hooks, hook)

    # ---- traversal
    def named_children(self):
        return iter(self._modules.items())

    def children(self):
        return iter(self._modules.values())

    def named_modules(self, prefix=""):
        seen = set()
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            children = [(f"{name}.{n}" if name else n, m) for n, m in module._modules.items()]
            stack.extend(reversed(children))

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix="", recurse=True):
        """(dotted name, Parameter) pairs; a Parameter shared by two modules is listed once."""
        seen = set()
        modules = self.named_modules(prefix) if recurse else [(prefix, self)]
        for mod_name, module in modules:
            for name, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self, recurse=True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def num_parameters(self):
        return sum(p.size for p in self.parameters())

    # ---- state
    def state_dict(self):
        """name -> array (references, not copies, as PyTorch's state_dict holds references)."""
        return OrderedDict((name, p.data) for name, p in self.named_parameters())

    def load_state_dict(self, state_dict, strict=True):
        """Copy arrays into the parameters, checking names and shapes (host or device values: each
        is copied to where its parameter lives)."""
        params = dict(self.named_parameters())
        missing = [k for k in params if k not in state_dict]
        unexpected = [k for k in state_dict if k not in params]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, value in state_dict.items():
            if name not in params:
                continue
            p = params[name]
            value = value.data if isinstance(value, Tensor) else value
            if tuple(value.shape) != p.shape:
                raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)}, "
                                 f"the model expects {p.shape}")
            # as PyTorch's copy_: the value is copied to where the parameter lives (a counted move)
            p.data[...] = backend.to_device(value) if backend.is_device_array(p.data) else backend.to_host(value)
        return missing, unexpected

    def to(self, dtype):
        """Cast every parameter to ``dtype`` in place (``model.to(np.float16)``, ``model.to(bfloat16)``
        with ``from ml_dtypes import bfloat16``), as ``torch.nn.Module.to(dtype)``."""
        for q in self.parameters():
            if q.dtype != dtype:
                q.data = q.data.astype(dtype)
        return self

    def train(self, mode=True):
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def requires_grad_(self, requires_grad=True):
        """Freeze (False) or unfreeze every parameter, as ``torch.nn.Module.requires_grad_``."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none=True):
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def apply(self, fn):
        for m in self.modules():
            fn(m)
        return self

    # ---- printing
    def extra_repr(self):
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child_repr}")
        return "\n".join(lines) + ("\n)" if len(lines) > 1 else ")")

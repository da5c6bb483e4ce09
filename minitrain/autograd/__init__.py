"""A small reverse-mode autograd engine on NumPy/CuPy arrays (see engine.py for how backward runs)."""
from .tensor import Tensor
from .hooks import RemovableHandle
from .creation import tensor, cat, split, zeros, ones, randn
from .function import Function
from .grad_mode import no_grad, enable_grad, is_grad_enabled, set_grad_enabled
from .graph import saved_tensors_hooks
from .deferred import WeightGradients, defer_weight_grads
from . import ops

__all__ = ["Tensor", "tensor", "cat", "split", "zeros", "ones", "randn", "Function", "no_grad",
           "enable_grad", "is_grad_enabled", "set_grad_enabled", "saved_tensors_hooks", "ops",
           "defer_weight_grads", "WeightGradients",
           "RemovableHandle"]

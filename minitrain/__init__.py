"""minitrain: distributed deep-learning training from scratch.

An autograd engine on NumPy (CuPy on GPUs), hand-written collectives, and the parallel
strategies built on them. See README.md, docs/reading.md (which function to read, in what order) and
docs/architecture.md (the layers, the rooms, how a step flows).
"""
from .backend import set_device, get_device, set_default_dtype, get_default_dtype
from .random import manual_seed
from .autograd import (Tensor, tensor, cat, split, zeros, ones, randn, Function, no_grad,
                       enable_grad, is_grad_enabled, set_grad_enabled, saved_tensors_hooks)
from . import backend, memory, random
from . import nn, optim, data  # noqa: E402  (after the autograd names they build on)

__version__ = "0.1.0"

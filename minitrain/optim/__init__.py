"""Optimizers with PyTorch's update rules, and global-norm gradient clipping."""
from .optimizer import Optimizer
from .sgd import SGD
from .adam import Adam, AdamW
from .clip import clip_grad_norm_, grad_norm_squared

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "grad_norm_squared"]

"""Optimizers with PyTorch's update rules, global-norm gradient clipping, and fp32 master weights
for mixed precision."""
from .optimizer import Optimizer
from .sgd import SGD
from .adam import Adam, AdamW
from .clip import clip_grad_norm_, grad_norm_squared
from .mixed_precision import MixedPrecisionOptimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "grad_norm_squared",
           "MixedPrecisionOptimizer"]

"""Optimizers with PyTorch's update rules, global-norm gradient clipping, fp32 master weights
for mixed precision, and learning-rate schedulers (optim.lr_scheduler)."""
from .optimizer import Optimizer
from .sgd import SGD
from .adam import Adam, AdamW
from .clip import clip_grad_norm_, sum_of_squares
from .mixed_precision import MixedPrecisionOptimizer
from . import lr_scheduler

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "sum_of_squares",
           "MixedPrecisionOptimizer", "lr_scheduler"]

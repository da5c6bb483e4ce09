"""Parallel strategies: each wraps an ordinary model and adds communication at a few points."""
from .data_parallel import DistributedDataParallel, LocalSGD, check_replicas_equal, parameters_digest

__all__ = ["DistributedDataParallel", "LocalSGD", "check_replicas_equal", "parameters_digest"]

"""Parallel strategies: each wraps an ordinary model and adds communication at a few points."""
from .data_parallel import DistributedDataParallel, check_replicas_equal, parameters_digest

__all__ = ["DistributedDataParallel", "check_replicas_equal", "parameters_digest"]

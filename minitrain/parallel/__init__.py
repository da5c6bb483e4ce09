"""Parallel strategies: each wraps an ordinary model and adds communication at a few points."""
from .data_parallel import DistributedDataParallel, LocalSGD, check_replicas_equal, parameters_digest
from .dp_single_process import DataParallel

__all__ = ["DistributedDataParallel", "DataParallel", "LocalSGD", "check_replicas_equal", "parameters_digest"]

"""Parallel strategies: each wraps an ordinary model and adds communication at a few points."""
from .data_parallel import DistributedDataParallel, LocalSGD, check_replicas_equal, parameters_digest
from .dp_single_process import DataParallel
from .recompute import checkpoint, checkpoint_sequential
from .offload import CPUOffloadOptimizer, found_inf_on_any_rank, offload_activations
from .zero import ZeroRedundancyOptimizer
from .fsdp import FullyShardedDataParallel

__all__ = ["DistributedDataParallel", "DataParallel", "LocalSGD", "check_replicas_equal", "parameters_digest",
           "checkpoint", "checkpoint_sequential", "CPUOffloadOptimizer", "found_inf_on_any_rank", "offload_activations",
           "ZeroRedundancyOptimizer", "FullyShardedDataParallel"]

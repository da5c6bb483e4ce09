"""Parallel strategies: each wraps an ordinary model and adds communication at a few points."""
from .data_parallel import DistributedDataParallel, LocalSGD, check_replicas_equal, parameters_digest
from .dp_single_process import DataParallel

__all__ = ["DistributedDataParallel", "DataParallel", "LocalSGD", "check_replicas_equal", "parameters_digest"]
from .recompute import checkpoint, checkpoint_sequential  # noqa: E402
from .offload import offload_activations  # noqa: E402

__all__ += ["checkpoint", "checkpoint_sequential", "offload_activations"]
from .zero import ZeroRedundancyOptimizer  # noqa: E402

__all__ += ["ZeroRedundancyOptimizer"]
from .fsdp import FullyShardedDataParallel  # noqa: E402

__all__ += ["FullyShardedDataParallel"]

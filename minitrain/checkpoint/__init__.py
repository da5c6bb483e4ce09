"""Checkpoints: save the whole training state sharded, resume exactly, load into any layout.

    path = checkpoint.save("ckpt", comm, step, model, optimizer, scheduler, extra={...}, layout={...})
    loaded = checkpoint.load(checkpoint.find_latest("ckpt", comm), comm, model, optimizer, scheduler)

A checkpoint is a set of *logical* tensors (what one process would hold) and a map of which rank
file holds which slice of each (manifest.json, one rank-NNNNN.safetensors per rank). Every
rank writes only its own pieces, a replicated piece once; loading reads, on every rank, only the
saved pieces that intersect the slices its own layout holds: ZeRO-3 on 4 ranks -> DDP on 2 -> one
process, or GPT dp=4 -> tp=2 x pp=2 -> one process. python -m minitrain.checkpoint inspect DIR.
Cost: bytes written = the model states once (no replica twice); extra memory per rank <= one piece.
(This is torch.distributed.checkpoint's job; activation recomputation, torch.utils.checkpoint's, is
minitrain.parallel.checkpoint.)
"""
from .core import Reader, all_gather_json
from .manifest import (damaged_step_folders, describe, describe_layout, latest, list_checkpoints, read_manifest,
                       step_folders)
from .state import Loaded, find_latest, load, save, sharded_parameters
from .storage import CheckpointError

__all__ = ["save", "load", "find_latest", "latest", "list_checkpoints", "read_manifest", "describe",
           "describe_layout", "Loaded", "Reader", "CheckpointError", "sharded_parameters", "all_gather_json",
           "step_folders", "damaged_step_folders"]

"""Where a GPT3D rank's parameters sit in the GPT's logical tensors (the sharded checkpoint's placements,
minitrain/sharded.py): its stage's parameters, each its tensor-parallel slice, or with ZeRO-3 the shard cut
across them; with ep > 1 each expert whole under its global name."""
import math

from ..sharded import Slice, whole
from .expert_parallel_3d import ExpertZero


def sharded_parameters(model):
    """Where this rank's parameters sit in the GPT's logical tensors: its pipeline stage's only,
    each as its tensor-parallel slice (c_attn's rows are three blocks, q, k and v, each cut by heads;
    the vocabulary's padding rows are left out). Replicas (dp, and tp for LayerNorms) hold the same
    slices; the checkpoint writes those once. With ep > 1 each expert is whole under its global name
    (h.i.mlp.experts.e.*) on the ranks that hold it."""
    t, r = model.tp, model.mesh.coordinate("tp")
    vocab = model.model.config.vocab_size
    local = {id(q) for q in model.pipe.parameters()}
    placements = []
    for name, (q, axis) in model.model._shards().items():
        if id(q) not in local:
            continue
        shape = tuple(q.shape)
        if axis is None:
            pieces = [whole(shape)]
        elif axis == "qkv":                      # rows [j·C + r·w, j·C + (r+1)·w) for j = q, k, v
            w, row = shape[0] // 3, math.prod(shape[1:])
            full = (3 * w * t,) + shape[1:]
            pieces = [Slice(full, (j * w * t + r * w,) + (0,) * (len(shape) - 1), (w,) + shape[1:], j * w * row)
                      for j in range(3)]
        else:
            full, offsets, sizes = list(shape), [0] * len(shape), list(shape)
            full[axis] *= t
            offsets[axis] = r * shape[axis]
            if name in ("wte.weight", "lm_head.weight"):      # rows past the vocabulary are padding
                full[0] = vocab
                sizes[0] = max(0, min(shape[0], vocab - offsets[0]))
            pieces = [Slice(tuple(full), tuple(offsets), tuple(sizes), 0)] if sizes[0] else []
        placements.append((q, [(name, s) for s in pieces]))
    if model.zero is not None and model.zero.stage == 3:       # the parameters are the shard, cut across them
        by_id = {id(q): pieces for q, pieces in placements}
        if isinstance(model.zero, ExpertZero):                 # two shards: the dense and the experts'
            return model.zero.shard_placements(by_id)
        return [(model.zero.shard, model.zero.shard_placements(by_id))]
    return placements

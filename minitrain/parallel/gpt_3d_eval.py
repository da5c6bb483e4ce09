"""The GPT3D's evaluation pass: the global batch's mean cross-entropy with no rank holding the whole model
(Megatron-LM's evaluate(): the forward alone, through the same mesh as training).

Each dp replica takes the rows train_step gives it (and each cp rank its positions of them); the pipeline
runs the forward of every micro-batch (pipeline/forward_only.py: no graph, no backward), the tensor-parallel
ranks of a stage in lockstep, a ZeRO-3 stage's parameters gathered for it and released after. The modules
are in eval mode meanwhile (dropout off; an MoE loss is the cross-entropy alone, as the GPT's in eval mode),
then back in the mode they were in, and the counts a job reads per step are left as they were. Each rank's
loss is the mean over its replica's rows at its positions; weighted by the replica's rows and summed over
dp x cp it is the global mean, as the unsharded GPT computes it in eval mode (float64: to rounding,
tests/test_five_axes.py).
"""
import numpy as np

from ..comm import all_reduce
from .pipeline.forward_only import eval_step as pipeline_eval_step


#: what a forward adds to for the job's step figures (experts' rows and all-to-all bytes, ring attention's work):
#: an evaluation leaves them as they were
COUNTERS = ("rows_taken", "rows_routed", "all_to_all_bytes_formula", "computed")


def eval_step(model, idx, targets):
    """The mean loss of ``model`` (a GPT3D) over the global batch (idx, targets), the same on every rank."""
    n = len(idx)
    idx, targets, rows = model.replica_batch(idx, targets)
    modes = [(m, m.training) for m in model.layers.modules()]
    counts = [(m, name, getattr(m, name)) for m, _ in modes for name in COUNTERS if hasattr(m, name)]
    model.layers.eval()
    if model.zero is not None:
        model.zero.gather_parameters()
    try:
        _, loss = pipeline_eval_step(model.pipe, idx, targets, model.model.loss)
    finally:
        if model.zero is not None:
            model.zero.release_parameters()
        for module, training in modes:
            module.training = training
        for module, name, value in counts:
            setattr(module, name, value)
    # a replica without rows (a batch smaller than dp) ran the forward on none and adds nothing
    total = all_reduce(model.mesh.comm("dp_cp"), np.array([float(loss) * rows if rows else 0.0]), op="sum")[0]
    return float(total / (n * model.cp))

"""What a pipeline step does after its last action: the loss every rank returns, and (2D: dp x pp)
the data-parallel replicas' gradients averaged, as DDP averages them (find_unused_parameters too)."""
import numpy as np

from ... import backend
from ...backend import array_module, is_device_array
from ...comm import all_reduce, all_reduce_coalesced


def mean_loss(values, weights, m):
    """The mean of the micro-batches' losses as a float (on the GPU: one synchronisation); values
    are the last stage's per-micro-batch losses, weights their shares of the batch (1/m when even)."""
    if not values:
        return 0.0
    if any(w != 1.0 / m for w in weights) or len(values) != m:     # uneven micro-batches
        xp = array_module(values[0])
        return backend.to_scalar((xp.stack(values).astype(np.float64) * xp.asarray(weights)).sum())
    if is_device_array(values[0]):
        return backend.to_scalar(array_module(values[0]).stack(values).astype(np.float64).sum()) / m
    return sum(float(v) for v in values) / m


def all_reduce_loss(comm, values, weights, m):
    """The mean loss on every rank of the pipeline (the last stage's; 0 elsewhere): every rank leaves together."""
    return float(all_reduce(comm, np.array([mean_loss(values, weights, m)]), op="sum")[0])


def all_reduce_dp_gradients(dp_comm, params, find_unused_parameters, op="mean"):
    """The gradients averaged over the dp replicas (op "sum": summed, each replica's already divided by
    their number: 16-bit gradients). With find_unused_parameters (an expert no token of a replica chose),
    see used_anywhere: every replica must reduce the same list."""
    if find_unused_parameters:
        params = used_anywhere(dp_comm, params)
    all_reduce_coalesced(dp_comm, [q.grad for q in params if q.grad is not None], op=op)


def used_anywhere(comm, params):
    """The ``params`` that some rank of ``comm`` has a gradient for (one all-reduce of a flag each), those
    without one here given zeros: the list every rank then reduces alike. One no rank used keeps grad None."""
    used = all_reduce(comm, np.array([q.grad is not None for q in params], np.float64))
    params = [q for q, n in zip(params, used) if n > 0]
    for q in params:
        if q.grad is None:
            q.grad = array_module(q.data).zeros(q.shape, q.dtype)
    return params

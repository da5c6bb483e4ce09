"""Model states per rank in bytes, minitrain's way (what its ledger counts for parameters, gradients and the
optimizer's state at rest, by ZeRO stage, precision and optimizer), and the categories memory is counted in.
DDP holds two bucket copies of the gradients (2Ψ·b), ZeRO-1 a flat gradient and a shard scratch, ZeRO-2 a
staging buffer of Ψ; mixed precision counts the fp32 gradients while the optimizer steps.
"""
from .layout import PRECISIONS

CATEGORIES = ("params", "grads", "optimizer_state", "activations", "comm_buffers")


def _state_kind(layout):
    """(bytes of one element of optimizer state: fp32, or fp64 in fp64 training; the moments per parameter:
    Adam's two, SGD's one momentum)."""
    return (4 if layout.mixed else PRECISIONS[layout.precision]), (1 if layout.optimizer == "sgd" else 2)


def _share(n, layout):
    """(n padded to a multiple of the dp ranks under ZeRO, the parameters this rank's optimizer steps)."""
    pad = -(-n // layout.dp) * layout.dp if layout.zero else n
    return pad, (n if layout.zero == 0 else pad // layout.dp)


def zero3_share(units, n_ranks):
    """Elements of one rank's ZeRO-3 shard: each FSDP unit (a list of parameter sizes) flattened, padded to a
    multiple of the ranks and split among them."""
    return sum(-(-sum(u) // n_ranks) * n_ranks for u in units) // n_ranks


def optimizer_bytes(n, layout):
    """Optimizer state for n parameters: Adam's two moments (SGD's one momentum) in fp32 or fp64, plus
    fp32 master weights under mixed precision or --offload (which puts all of it on the host)."""
    width, moments = _state_kind(layout)
    return 0 if layout.offload else n * width * (moments + (1 if layout.mixed else 0))


def fp32_step_grads(n, layout):
    """MixedPrecisionOptimizer counts the fp32 copy of the gradients while it steps (on the host if offloaded)."""
    return 4 * n if layout.mixed and not layout.offload else 0


def model_states_at_rest(n, layout):
    """``plan params``: what minitrain holds for n parameters at the optimizer step, without the
    layer-dependent transients (ZeRO-3's gathered unit and staging buffers need the layers' sizes)."""
    e, z, N = PRECISIONS[layout.precision], layout.zero, layout.dp
    pad, state_n = _share(n, layout)
    row = {"params": e * (pad // N if z == 3 else pad), "optimizer_state": optimizer_bytes(state_n, layout),
           "grads": e * {0: n, 1: pad, 2: pad // N, 3: pad // N}[z] + fp32_step_grads(state_n, layout),
           "activations": 0, "comm_buffers": {0: 2 * e * n, 1: e * pad // N, 2: e * pad, 3: 0}[z]}
    if layout.offload and z == 3:                 # FSDP offload_params: shards and their gradients on the host
        row.update(params=0, grads=0)
    return {**{c: int(row[c]) for c in CATEGORIES}, "total": int(sum(row.values()))}


def offloaded_states(n, layout, units=None):
    """What --offload puts on the host for n parameters (the ledger's "host" entries): the optimizer's state of
    this rank's share with an fp32 (fp64) master copy (CPUOffloadOptimizer), and under ZeRO-3 the parameter and
    gradient shards (FSDP's offload_params; ``units``: its units' parameter sizes, each padded on its own; none:
    the parameters as one unit). Zeros without --offload."""
    pad, state_n = _share(n, layout)
    if layout.zero == 3 and units is not None:
        state_n = zero3_share(units, layout.dp)
    shard = PRECISIONS[layout.precision] * state_n if layout.offload and layout.zero == 3 else 0
    width, moments = _state_kind(layout)
    row = {"params": shard, "grads": shard,                   # (the master copy: + 1 moment's worth)
           "optimizer_state": state_n * width * (moments + 1) if layout.offload else 0}
    return {**{c: int(v) for c, v in row.items()}, "total": int(sum(row.values()))}


def _one_moment(row):
    """A row whose categories are held all at once (model states at rest, the papers' sums)."""
    parts = {c: int(round(row.get(c, 0))) for c in CATEGORIES}
    return {**parts, "total": sum(parts.values()), "category_peaks": dict(parts)}

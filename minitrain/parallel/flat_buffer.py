"""One flat buffer for many parameters, padded to a multiple of the world size p: the layout of
ZeRO's partitions (Rajbhandari et al. 2020, sec. 5) and of PyTorch FSDP's FlatParameter (Zhao et
al. 2023, sec. 3.2). Parameter i occupies [offset_i, offset_i + numel_i), the padding (at most p - 1
elements, zeros) sits at the end, and rank r's shard is the contiguous slice [r·S, (r+1)·S),
S = ceil(Ψ / p): a reduce-scatter of a padded gradient buffer lands each rank's shard in place, an
all-gather of the shards rebuilds the whole buffer. Memory: Ψ_pad = p·S elements per buffer.
"""
import math

from ..backend import array_module
from ..sharded import flat_buffer_slices


class FlatParamBuffer:
    """``FlatParamBuffer(params, p, rank)``: the parameters' values copied end to end into ``data``
    (a flat array of ``padded`` elements); ``view(q)`` is parameter q's part of it in q's shape,
    ``shard()`` rank ``rank``'s slice. ``data`` may be dropped (set to None) and replaced by another
    buffer of the same layout (FSDP frees a unit and gathers it again); ``new()`` makes one."""

    def __init__(self, params, p, rank, who="a flat buffer"):
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{who}: no parameter to flatten")
        dtypes = {q.dtype for q in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"{who} flattens parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = self.params[0].dtype
        self.xp = array_module(self.params[0].data)
        self.numel = sum(q.size for q in self.params)
        self.shard_size = math.ceil(self.numel / p)
        self.padded = self.shard_size * p
        self.offsets = {}                            # id(parameter) -> (start, end) in the buffer
        offset = 0
        for q in self.params:
            self.offsets[id(q)] = (offset, offset + q.size)
            offset += q.size
        self.shard_range = (rank * self.shard_size, (rank + 1) * self.shard_size)
        self.data = self.new()
        for q in self.params:
            self.view(q)[...] = q.data

    def new(self):
        """A zeroed buffer of this layout (a gradient buffer, a staging buffer, a gathered unit)."""
        return self.xp.zeros(self.padded, self.dtype)

    def view(self, q, buffer=None):
        """Parameter q's part of ``buffer`` (default: ``data``), shaped like q."""
        lo, hi = self.offsets[id(q)]
        return (self.data if buffer is None else buffer)[lo:hi].reshape(q.shape)

    def shard(self, buffer=None):
        """This rank's contiguous slice [r·S, (r+1)·S) of ``buffer`` (default: ``data``)."""
        lo, hi = self.shard_range
        return (self.data if buffer is None else buffer)[lo:hi]

    def point_params_at(self, buffer=None):
        """Make every parameter a view of ``buffer`` (default: ``data``): its memory is the buffer's."""
        for q in self.params:
            q.data = self.view(q, buffer)

    def shard_slices(self, names, lo=None, hi=None):
        """Where this rank's shard (or the range [lo, hi) of the buffer) sits in the parameters'
        logical tensors (padding excluded); ``names``: id(parameter) -> its logical name."""
        entries = [(names[id(q)], q.shape, self.offsets[id(q)][0]) for q in self.params]
        return flat_buffer_slices(entries, *((lo, hi) if lo is not None else self.shard_range))

"""Offload to host memory: activations (the other answer to activation memory, besides
recomputation) and model states (ZeRO-Offload, Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training").

CPUOffloadOptimizer(params, optim.Adam, lr=...): the fp32 master weights and the optimizer
state live on the host and the update runs there (ZeRO-Offload's CPU Adam); each step the gradients
go device -> host and the updated weights host -> device. The device keeps only the parameters
and gradients: 2Ψ + 2Ψ in mixed precision (4Ψ + 4Ψ in fp32) instead of 16Ψ. It is the optimizer
inside ZeRO-1/2 with offload=True; FSDP's offload_params=True moves the shards too.

with offload_activations() as moved: packs every array an operation saves for backward into
host memory and unpacks it back in backward (a saved-tensor hooks context). On CuPy the copies are
real device <-> host transfers; on NumPy the array simply leaves the teaching device's budget
(minitrain.memory counts activations on the device only) without being copied. Parameters that
operations save (a Linear's weight) stay where they are: they live on the device anyway.
moved counts the bytes each way.
"""
from .. import backend, memory
from ..autograd.graph import saved_tensors_hooks
from ..comm import all_reduce
from ..optim.mixed_precision import MixedPrecisionOptimizer


def found_inf_on_any_rank(comm):
    """The reduction a mixed-precision optimizer of sharded parameters needs (all_reduce_found_inf):
    the maximum of the ranks' inf/NaN flags, so that every rank skips the same steps. One all-reduce
    of one number per step."""
    return lambda flag: all_reduce(comm, flag, op="max")


class CPUOffloadOptimizer(MixedPrecisionOptimizer):
    """fp32 master weights + optimizer state on the host; parameters of any float dtype on the
    device (float16/bfloat16 get the loss scaling of MixedPrecisionOptimizer)."""

    offload = True


class HostArray:
    """An array parked in host memory (not an ndarray, so the device tracker does not count it)."""

    __slots__ = ("array", "on_device")

    def __init__(self, array, on_device):
        self.array, self.on_device = array, on_device


class offload_activations(saved_tensors_hooks):
    """``with offload_activations() as moved:`` parks saved activations on the host (see above)."""

    def __init__(self):
        self.bytes_offloaded = 0
        self.bytes_restored = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, a):
        if not hasattr(a, "nbytes") or memory.tracker().contains(("params", id(memory.owner(a)))):
            return a
        self.bytes_offloaded += a.nbytes
        on_device = backend.is_device_array(a)
        return HostArray(backend.to_host(a) if on_device else a, on_device)

    def _unpack(self, packed):
        if not isinstance(packed, HostArray):
            return packed
        self.bytes_restored += packed.array.nbytes
        return backend.to_device(packed.array) if packed.on_device else packed.array

"""Activation offload: the other answer to activation memory (besides recomputation).

``with offload_activations() as moved:`` packs every array an operation saves for backward into
host memory and unpacks it back in backward (a saved-tensor hooks context). On CuPy the copies are
real device <-> host transfers; on NumPy the array simply leaves the teaching device's budget
(``minitrain.memory`` counts activations on the device only) without being copied. Parameters that
operations save (a Linear's weight) stay where they are: they live on the device anyway.
``moved`` counts the bytes each way.
"""
from .. import backend, memory
from ..autograd.graph import saved_tensors_hooks


class HostArray:
    """An array parked in host memory (not an ndarray, so the device tracker does not count it)."""

    __slots__ = ("array", "on_device")

    def __init__(self, array, on_device):
        self.array, self.on_device = array, on_device


class offload_activations(saved_tensors_hooks):
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

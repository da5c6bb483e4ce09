"""Which ranks share a GPU. A device index names a GPU only inside one process (ranks may see different
CUDA_VISIBLE_DEVICES, each calling its GPU 0), so ranks compare their node and the GPU's PCI address."""
import socket
import zlib

from .. import backend


def gpu_place():
    """(node, GPU, device index) of this rank's current GPU, as integers every rank can compare: the host
    name's CRC-32 and the PCI domain / bus / device of the GPU."""
    runtime = backend._import_cupy().cuda.runtime
    device = runtime.getDevice()
    props = runtime.getDeviceProperties(device)
    pci = (props.get("pciDomainID", 0) << 16) | props.get("pciBusID", device) << 8 | props.get("pciDeviceID", 0)
    return zlib.crc32(socket.gethostname().encode()), pci, device


def shared_gpus(places):
    """[(ranks, device index on the first of them)] for each GPU that more than one rank uses, from every
    rank's gpu_place() (places[r] is rank r's)."""
    by_gpu = {}
    for rank, (node, pci, _) in enumerate(places):
        by_gpu.setdefault((node, pci), []).append(rank)
    return [(ranks, places[ranks[0]][2]) for ranks in by_gpu.values() if len(ranks) > 1]

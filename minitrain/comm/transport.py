"""Which transport moves a communicator's device buffers: chosen once, when the job starts.

Host (NumPy) arrays go to MPI as they are (host.py). A device (CuPy) array goes through the
communicator's device transport, the first of these that works here (describe(comm) names it in the
job's table); each implements the one interface of wire.py, and the collectives name none of them:

  cuda-aware-mpi  MPI reads and writes device memory itself (staging.py)
  cuda-ipc        ranks on one node map each other's device memory (ipc.py): the receiver's kernel
                  reads the sender's buffer, N·b bytes through HBM / NVLink, no host copy
  pinned-staging  device -> pinned host -> MPI -> pinned host -> device (staging.py)

NCCL is a backend of its own (nccl.py: comm.init(backend="nccl")).
"""
import os
import sys

from .. import backend
from .errors import Unavailable
from .gpu_places import gpu_place, shared_gpus
from .host import DevicePointerRefused, mpi_buffer, mpi_is_cuda_aware  # noqa: F401  (this module's names)
from .staging import CudaAwareMPITransport, PinnedPool, PinnedStagingTransport, StagedRequest, _view  # noqa: F401

NAMES = ("cuda-aware-mpi", "cuda-ipc", "pinned-staging")


class TransportUnavailable(Unavailable):
    """The transport asked for cannot work here (raised on every rank: the choice is collective)."""


# ---------------------------------------------------------------- choosing one
def choose(comm, want="auto"):
    """(transport, note) for an MPICommunicator on the GPU; collective (every rank calls it, and all
    reach the same answer). ``want``: auto (the first that works, in the order of NAMES) or one of
    NAMES (an error if it cannot work here). The note says what was passed over and why."""
    if want not in ("auto",) + NAMES:
        raise ValueError(f"unknown transport {want!r}: expected auto or one of {NAMES}")
    notes = []
    if want in ("auto", "cuda-aware-mpi"):
        if mpi_is_cuda_aware():
            return CudaAwareMPITransport(comm), ""
        if want == "cuda-aware-mpi":
            raise TransportUnavailable("transport 'cuda-aware-mpi': this MPI is not CUDA-aware (MPIX_Query_cuda_support() is 0)")
        notes.append("MPI is not CUDA-aware")
    if want in ("auto", "cuda-ipc"):
        from .ipc import negotiate
        ipc, why = negotiate(comm)
        if ipc is not None:
            return ipc, "; ".join(notes + ([why] if why else []))
        if want == "cuda-ipc":
            raise TransportUnavailable(f"transport 'cuda-ipc' cannot work here: {why}")
        notes.append(f"no CUDA IPC: {why}")
    return PinnedStagingTransport(comm), "; ".join(notes)


def setup(comm, transport=None):
    """Give an MPICommunicator its device transport (on the GPU; on the CPU only host arrays move).
    ``transport``: None reads MINITRAIN_TRANSPORT (default auto). A fallback is said once, on rank 0."""
    want = transport or os.environ.get("MINITRAIN_TRANSPORT") or "auto"
    if want not in ("auto",) + NAMES:
        raise TransportUnavailable(f"unknown transport {want!r}: expected auto or one of {NAMES}")
    if backend.get_device() != "cuda":
        if want != "auto":
            raise TransportUnavailable(f"transport {want!r} moves device buffers: select the GPU first "
                                       f"(MINITRAIN_DEVICE=cuda)")
        return comm
    comm.transport, note = choose(comm, want)
    comm.transport_note = "; ".join(n for n in (note, shared_gpu_note(comm)) if n)
    if comm.transport_note and comm.rank == 0:
        sys.stderr.write(f"minitrain: device buffers move by {comm.transport.name} ({comm.transport_note})\n")
        sys.stderr.flush()
    return comm


def mps_running():
    """Whether an MPS control daemon answers here (its pipe directory: CUDA_MPS_PIPE_DIRECTORY, default
    /tmp/nvidia-mps, holds the control pipe)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))


def shared_gpu_note(comm):
    """What to say when ranks share a GPU without MPS (collective): the GPU then runs one process's kernels
    at a time and switches between them, and every hop that waits for a peer's kernel or copy pays for a
    switch (measured on an H200, two ranks: 142 us a hop against 8 us under MPS; docs/measured.md)."""
    places = comm.mpi_comm.allgather((gpu_place(), mps_running()))
    shared = [f"ranks {ranks} share GPU {device}" for ranks, device in shared_gpus([place for place, _ in places])
              if not all(places[r][1] for r in ranks)]
    return (", ".join(shared) + " without MPS: their kernels take turns on it, each hop paying for a switch; start "
            "the MPS daemon (nvidia-cuda-mps-control -d) before the job") if shared else ""


def default_transport(comm):
    """The transport of a communicator nobody negotiated for: one that needs no agreement between ranks
    (CUDA-aware MPI, else pinned staging: both put plain MPI messages on the wire)."""
    return CudaAwareMPITransport(comm) if mpi_is_cuda_aware() else PinnedStagingTransport(comm)


def describe(comm):
    """The name the job's table prints: nccl, a device transport, host (the CPU), or in-process."""
    if getattr(comm, "backend_name", None) == "nccl":
        return "nccl"
    if not hasattr(comm, "mpi_comm"):
        return "in-process"
    if backend.get_device() != "cuda":
        return "host"
    t = getattr(comm, "transport", None)
    if t is not None:
        return t.name
    return "cuda-aware-mpi" if mpi_is_cuda_aware() else "pinned-staging"

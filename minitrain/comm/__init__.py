"""Communication: the Communicator (MPI or threads), hand-written collectives, async Work, mesh.
Every byte that crosses ranks goes through here, where it is counted, traced and checked."""
from .communicator import (Communicator, CommStats, CommError, CollectiveTimeout,
                           CollectiveMismatchError, RankFailedError)
from .local import ThreadWorld, ThreadCommunicator
from .work import Work
from .mesh import DeviceMesh, MeshError
from .collectives import (ring_all_reduce, ring_reduce_scatter, ring_all_gather, broadcast, reduce,
                          naive_all_reduce, recursive_doubling_all_reduce, all_to_all, all_reduce,
                          chunk_bounds)


def init(timeout=None, limit_threads=True, *, backend=None, transport=None):
    """MPI entry point (see mpi.py): COMM_WORLD, BLAS threads capped, abort-on-error hook, this
    rank's GPU. ``backend``: "mpi" (the hand-written collectives over MPI point-to-point) or "nccl"
    (over NCCL's send/recv: nccl.py); default MINITRAIN_BACKEND, else mpi. ``transport``: how device
    buffers move under mpi (transport.py: auto, cuda-aware-mpi, cuda-ipc, pinned-staging); default
    MINITRAIN_TRANSPORT, else auto. Both are named in the job's table (``transport.describe(comm)``)."""
    import os
    from .mpi import init as mpi_init
    from .transport import setup
    comm = mpi_init(timeout=timeout, limit_threads=limit_threads)
    backend = backend or os.environ.get("MINITRAIN_BACKEND") or "mpi"
    if backend == "nccl":
        from .nccl import NCCLCommunicator
        return NCCLCommunicator(comm)
    if backend != "mpi":
        raise ValueError(f"unknown backend {backend!r}: expected 'mpi' or 'nccl'")
    return setup(comm, transport)


def MPICommunicator(*args, **kwargs):  # noqa: N802  (imported lazily: mpi4py initialises MPI)
    from .mpi import MPICommunicator as cls
    return cls(*args, **kwargs)


__all__ = ["Communicator", "CommStats", "CommError", "CollectiveTimeout", "CollectiveMismatchError",
           "RankFailedError", "ThreadWorld", "ThreadCommunicator", "Work", "DeviceMesh", "MeshError",
           "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast", "reduce",
           "naive_all_reduce", "recursive_doubling_all_reduce", "all_to_all", "all_reduce",
           "chunk_bounds", "init", "MPICommunicator"]

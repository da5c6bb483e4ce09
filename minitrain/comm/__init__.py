"""Communication in two layers: the core Communicator (point-to-point, tags; MPI, threads or NCCL
underneath, device buffers by one transport interface) with the hand-written collectives on it, and
the guard around it (header checks, the flight recorder that turns a hang into a report, stall and
death watches). Every byte that crosses ranks goes through here, where it is counted and checked."""
from .communicator import Communicator, DEFAULT_COMM_TIMEOUT
from .errors import CommError, CollectiveTimeout, CollectiveMismatchError, RankFailedError
from .stats import CommStats
from .flight_recorder import FlightRecorder
from .local import ThreadWorld, ThreadCommunicator
from .work import Work
from .mesh import DeviceMesh, MeshError
from .reductions import chunk_bounds
from .rings import ring_all_reduce, ring_reduce_scatter, ring_all_gather
from .collectives import (broadcast, reduce, naive_all_reduce, recursive_doubling_all_reduce, all_to_all, all_reduce,
                          all_reduce_coalesced, ALL_REDUCE_ALGORITHMS)
from .alltoallv import all_to_all_single


def init(timeout=None, limit_threads=True, *, comm_timeout=DEFAULT_COMM_TIMEOUT, check_collectives=True,
         backend=None, transport=None):
    """MPI entry point (see mpi.py): checks the launcher against the MPI library, COMM_WORLD as a
    Communicator, BLAS threads capped, this rank's GPU, the death watch and the abort-on-error hook.
    comm_timeout: seconds a wait may last before the ranks compare flight records (the stall
    threshold); timeout: the hard limit of any wait (default 3 x comm_timeout); check_collectives:
    compare each collective's name, sequence number, shape, dtype and op across ranks before it moves
    data. backend: "mpi" (the hand-written collectives over MPI point-to-point) or "nccl" (over
    NCCL's send/recv: nccl.py); default MINITRAIN_BACKEND, else mpi. transport: how device buffers
    move under mpi (transport.py: auto, cuda-aware-mpi, cuda-ipc, pinned-staging); default
    MINITRAIN_TRANSPORT, else auto. Both are named in the job's table (transport.describe(comm))."""
    import os
    from .mpi import init as mpi_init
    from .transport import setup
    comm = mpi_init(timeout=timeout, limit_threads=limit_threads, comm_timeout=comm_timeout,
                    check_collectives=check_collectives)
    backend = backend or os.environ.get("MINITRAIN_BACKEND") or "mpi"
    if backend == "nccl":
        from .nccl import NCCLCommunicator
        return NCCLCommunicator(comm)
    if backend != "mpi":
        from .errors import Unavailable
        raise Unavailable(f"unknown backend {backend!r}: expected 'mpi' or 'nccl'")
    return setup(comm, transport)


def MPICommunicator(*args, **kwargs):  # noqa: N802  (imported lazily: mpi4py initialises MPI)
    from .mpi import MPICommunicator as cls
    return cls(*args, **kwargs)


def mpi_library():
    """The MPI library this process runs on (first line of MPI_Get_library_version)."""
    from .launcher import mpi_library as name
    return name()


__all__ = ["Communicator", "CommStats", "CommError", "CollectiveTimeout", "CollectiveMismatchError",
           "RankFailedError", "FlightRecorder", "ThreadWorld", "ThreadCommunicator", "Work", "DeviceMesh",
           "MeshError", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast", "reduce",
           "naive_all_reduce", "recursive_doubling_all_reduce", "all_to_all", "all_to_all_single", "all_reduce",
           "all_reduce_coalesced", "chunk_bounds", "ALL_REDUCE_ALGORITHMS", "DEFAULT_COMM_TIMEOUT", "init", "MPICommunicator", "mpi_library"]

"""Is this process started right: the launcher's variables, the mpiexec that belongs to the MPI library
mpi4py loaded, and the refusal when they do not belong together (a launcher of one MPI with the library
of another makes every rank a world of one, each training alone). comm.init() calls check_launch first.
"""
import os
import sys

from .host import _mpi


def mpi_library():
    """The MPI this process runs on: the first line of MPI_Get_library_version."""
    return " ".join(_mpi().Get_library_version().strip().splitlines()[0].split())


LAUNCHER_SIZE_VARS = (("PMI_SIZE", "PMI_RANK", "an MPICH-style launcher (hydra's mpiexec, or a PMI launcher)"),
                      ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun"))


def launcher_size():
    """(processes the launcher started, this process's rank among them, variable, launcher) or None."""
    for size_var, rank_var, who in LAUNCHER_SIZE_VARS:
        if size_var in os.environ:
            try:
                return int(os.environ[size_var]), int(os.environ.get(rank_var, "0")), size_var, who
            except ValueError:
                continue
    return None


def matching_launcher():
    """The mpiexec that belongs to the MPI library this process loaded (best effort)."""
    lib = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libmpi" in line and ".so" in line:
                    lib = line.split()[-1]
                    break
    except OSError:
        pass
    candidates = []
    if lib:
        root = os.path.dirname(os.path.dirname(lib))
        candidates += [os.path.join(root, "bin", n) for n in ("mpiexec", "mpirun")]
    here = os.path.dirname(sys.executable)
    if "open mpi" in mpi_library().lower():
        candidates += ["/usr/bin/mpirun.openmpi", "/usr/bin/mpirun"]
    else:
        candidates += [os.path.join(here, "mpiexec"), "/usr/bin/mpiexec.hydra", "/usr/bin/mpiexec.mpich"]
    for c in candidates:
        if os.path.exists(c):
            return c, lib
    return None, lib


def check_launch():
    """A launcher of one MPI with the library of another makes every rank a world of one: stop."""
    launch = launcher_size()
    if launch is None or launch[0] <= 1 or _mpi().COMM_WORLD.Get_size() > 1:
        return
    size, rank, var, who = launch
    if rank != 0:
        raise SystemExit(1)
    exe, lib = matching_launcher()
    raise SystemExit(
        f"minitrain: this process is one of {size} started by {who} ({var}={size}), but MPI's COMM_WORLD has "
        f"1 rank: mpi4py runs on {mpi_library()}{' (' + lib + ')' if lib else ''}, which cannot join that "
        f"launcher's job, so every process would train alone. Launch with the mpiexec of that MPI"
        + (f": {exe} -n {size} ..." if exe else "") + " (or install mpi4py for the MPI whose mpiexec you use).")

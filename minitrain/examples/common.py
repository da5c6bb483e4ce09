"""What the example jobs share to start: where this process sits in an mpirun launch, the options every
job takes (--comm-timeout), argument parsing that speaks once for N ranks, the communicator, and the
names of the device, transport and MPI the job ran on (what they report: examples/report.py).

The launch is read from the MPI launcher's environment (MPICH's PMI_RANK/PMI_SIZE, Open MPI's
OMPI_COMM_WORLD_*), so no MPI is initialised for a 1-process job and a bad option is reported by
rank 0 alone before MPI starts.
"""
import argparse
import os
import sys

import numpy as np

from .. import backend, cli
from ..backend import bfloat16, launch_info
from ..comm.communicator import DEFAULT_COMM_TIMEOUT


#: --precision -> the parameters' and activations' dtype (fp16 / bf16: mixed precision, fp32 master weights)
PRECISIONS = {"fp32": np.float32, "fp64": np.float64, "fp16": np.float16, "bf16": bfloat16}


class _NoBar:
    """A progress bar that shows nothing (--no-progress, and every rank but rank 0): iterates, ignores the rest."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        pass

    def set_postfix(self, **values):
        pass

    def close(self):
        pass


def tqdm(iterable=None, disable=False, **options):
    """tqdm's progress bar (a dependency in setup.cfg), imported only where one is shown: importing tqdm costs
    ~35 ms of CPU, which every rank but rank 0 of every launch would pay for a bar it disables."""
    if disable:
        return _NoBar(iterable)
    from tqdm import tqdm as bar
    return bar(iterable, disable=False, **options)


def part_of_job(module, command):
    """What ``python -m minitrain.examples.MODULE`` does for a module that is half of a job (it has no main of
    its own, and would exit 0 having trained nothing): one line naming the job's command; the exit status 2."""
    sys.stderr.write(f"error: minitrain.examples.{module} is part of a job, not one: run {command}\n")
    return 2


def device_code():
    """This rank's device as a number for the per-rank tables: the GPU index, or -1 for the CPU."""
    return backend.gpu_index() if backend.get_device() == "cuda" else -1


def transport_name(comm):
    """How this job's device buffers cross ranks (minitrain/comm/transport.py), for its table and JSON."""
    from ..comm.transport import describe
    return describe(comm)


# ---------------------------------------------------------------- what every job takes and how it starts
class JobArgumentParser(argparse.ArgumentParser):
    """argparse for a job started as N processes: usage, help and errors are printed once (by the
    launcher's rank 0), and every rank exits with argparse's status (2 for a bad option). No abbreviations
    (Megatron's allow_abbrev=False): --offload must not be read as another option that begins with it."""

    def __init__(self, *args, allow_abbrev=False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def _print_message(self, message, file=None):
        if launch_info()[0] == 0:
            super()._print_message(message, file)


def add_job_options(parser):
    """The options every example takes (each job adds its own after these)."""
    parser.add_argument("--comm-timeout", type=cli.comm_timeout, default=DEFAULT_COMM_TIMEOUT, metavar="SECONDS",
                        help=f"stall threshold, at least {cli.MIN_COMM_TIMEOUT:g} s: a wait this long makes the ranks "
                             "compare their flight records (a rank at another call ends the job at once); any wait "
                             "ends the job at 3x this")
    parser.add_argument("--no-check-collectives", dest="check_collectives", action="store_false",
                        help="leave out the collective checks (each collective's header agreed by every rank before "
                             "data moves; the receive sizes); the flight recorder and the stall watch stay: to "
                             "measure what the checks cost (default: checks on)")
    return parser


def checks_line(args):
    """The table's words for the job's safety settings."""
    return (f"check_collectives {'on' if getattr(args, 'check_collectives', True) else 'off'}, "
            f"stall threshold {args.comm_timeout:g} s")


def job_parser(description):
    return add_job_options(JobArgumentParser(description=description, formatter_class=cli.HelpFormatter))


def parse_job_args(parser, argv=None):
    """``parser.parse_args``: usage and errors printed once, exit status 2 on every rank."""
    if not isinstance(parser, JobArgumentParser):
        parser.__class__ = type("Job" + type(parser).__name__, (JobArgumentParser, type(parser)), {})
    return parser.parse_args(argv)


def init_comm(args):
    """``minitrain.comm.init`` with the job's options: check_collectives (on unless --no-check-collectives),
    stall threshold ``--comm-timeout``, hard timeout 3x that; comm.init also picks the backend and the device
    transport (MINITRAIN_BACKEND, MINITRAIN_TRANSPORT; default mpi and auto). A backend or transport that
    cannot work here is refused as a bad option is: one line from rank 0, exit status 2 on every rank."""
    from .. import comm
    from ..comm.errors import Unavailable
    try:
        return comm.init(comm_timeout=args.comm_timeout, check_collectives=getattr(args, "check_collectives", True))
    except Unavailable as e:                  # raised on every rank alike
        if launch_info()[0] == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def mpi_line():
    """The MPI the job ran on, for its table (MPI_Get_library_version, never a fixed string)."""
    from ..comm import mpi_library
    return mpi_library()

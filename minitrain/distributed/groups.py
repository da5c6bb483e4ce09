"""torch.distributed's process groups over minitrain's communicators: the world from the MPI launcher,
new_group's sub-communicators (comm.split) and new_subgroups' (one new_group each), ranks in and out of a
group, PyTorch's reduction names."""
import datetime
import operator
import warnings

import numpy as np

from .. import backend as backend_module
from .. import comm as C


class ReduceOp:
    """PyTorch's reduction names; AVG of floating dtypes only (an integer mean is not an integer).
    BAND, BOR and BXOR are named so that a call with one is refused in one line (NCCL has none either)."""
    SUM, AVG, PRODUCT, MIN, MAX = "sum", "mean", "prod", "min", "max"
    BAND, BOR, BXOR = "band", "bor", "bxor"


class ProcessGroup:
    """A communicator and the global ranks it holds, in its rank order."""

    def __init__(self, communicator, ranks, backend, group_desc=None):
        self.comm, self.ranks, self.backend, self.group_desc = communicator, list(ranks), backend, group_desc

    def rank(self):
        return self.comm.rank

    def size(self):
        return self.comm.size

    def __repr__(self):
        return f"ProcessGroup(ranks={self.ranks}, backend={self.backend!r})"


class GroupMember:
    NON_GROUP_MEMBER = object()      # what new_group returns on a rank it leaves out


class group:                         # noqa: N801  (PyTorch's name: dist.group.WORLD)
    WORLD = None


_world = None
#: PyTorch's backend names, and the minitrain backend each one runs on (gloo's calls are MPI's here)
BACKENDS = {None: "mpi", "mpi": "mpi", "gloo": "mpi", "nccl": "nccl"}


# ---------------------------------------------------------------- the default group
def seconds(timeout):
    """PyTorch's ``timeout`` (a timedelta, or seconds as a number; None stays None) in seconds."""
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout


def _timeouts(timeout):
    """A communicator's keywords for PyTorch's ``timeout`` (a timedelta or seconds): the hard limit of a
    wait, and the stall report at a third of it (at most comm's default)."""
    if timeout is None:
        return {}
    return {"timeout": seconds(timeout), "comm_timeout": min(C.DEFAULT_COMM_TIMEOUT, seconds(timeout) / 3)}


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                       group_name="", pg_options=None, device_id=None):
    """The world's process group, from the MPI launcher's ranks (see the module docstring); None, as PyTorch's."""
    global _world
    if _world is not None:
        raise ValueError("trying to initialize the default process group twice!")
    if backend not in BACKENDS:
        raise ValueError(f"init_process_group: backend {backend!r} is not one of mpi, gloo, nccl")
    if init_method not in (None, "env://") or store is not None:
        raise ValueError(f"init_process_group: the MPI launcher does the rendezvous; init_method {init_method!r} / "
                         f"a store cannot say where the ranks are (leave them out, or init_method='env://')")
    for name, value in (("pg_options", pg_options), ("device_id", device_id)):
        if value is not None:
            raise ValueError(f"init_process_group: {name} is not supported here; leave it out")
    world = C.init(backend=BACKENDS[backend], **_timeouts(timeout))
    for name, given, actual in (("world_size", world_size, world.size), ("rank", rank, world.rank)):
        if given not in (-1, None) and given != actual:
            raise ValueError(f"init_process_group: {name}={given}, but the MPI launcher started this process as "
                             f"{name} {actual}")
    _world = group.WORLD = ProcessGroup(world, range(world.size), backend or "mpi")


def is_initialized():
    return _world is not None


def is_available():
    return True


def destroy_process_group(pg=None):
    """Forget the default group (pg=None) so that init_process_group may run again."""
    global _world
    if pg is None or pg is _world:
        _world = group.WORLD = None


def _group(pg, name):
    """The ProcessGroup a call runs on, or None where this rank is not in it (the call returns at once)."""
    if _world is None:
        raise ValueError(f"{name}: Default process group has not been initialized, please make sure to call "
                         f"init_process_group.")
    pg = _world if pg is None else pg
    if pg is GroupMember.NON_GROUP_MEMBER:
        warnings.warn(f"Running {name} on global rank {_world.comm.rank} which does not belong to the given group.")
        return None
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"{name}: group must be a group from new_group() or None (the world), got {type(pg).__name__}")
    return pg


def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
              group_desc=None, device_id=None, sort_ranks=True):
    """A group of ``ranks`` (global ranks; None: all), in rank order unless sort_ranks=False (then in the
    order given). Every rank of the world calls it, as in PyTorch; timeout: as init_process_group's."""
    world = _group(None, "new_group")
    try:
        chosen = list(range(world.size())) if ranks is None else [operator.index(r) for r in ranks]
    except TypeError:
        raise TypeError(f"new_group: ranks must be global ranks (integers), got {list(ranks)}") from None
    chosen = sorted(chosen) if sort_ranks else chosen
    if len(set(chosen)) != len(chosen) or not all(0 <= r < world.size() for r in chosen):
        raise ValueError(f"new_group: ranks {list(ranks)} must be distinct ranks of the world of size {world.size()}")
    if backend is not None and BACKENDS.get(backend) != BACKENDS[world.backend] or use_local_synchronization:
        raise ValueError("new_group: a group has the world's backend and synchronizes the whole world")
    for name, value in (("pg_options", pg_options), ("device_id", device_id)):
        if value is not None:
            raise ValueError(f"new_group: {name} is not supported here; leave it out")
    member = world.comm.rank in chosen
    sub = world.comm.split(1 if member else 0, chosen.index(world.comm.rank) if member else world.comm.rank)
    for name, value in _timeouts(timeout).items():
        setattr(sub, name, value)
    return ProcessGroup(sub, chosen, world.backend, group_desc) if member else GroupMember.NON_GROUP_MEMBER


def new_subgroups(group_size=None, group=None, timeout=None, backend=None, pg_options=None, group_desc=None):
    """Groups of ``group_size`` consecutive ranks of ``group`` (None: the world), as PyTorch's; group_size None:
    the ranks the MPI launcher put on each node (PyTorch's: the GPUs per node). Every rank of the world calls it,
    one outside ``group`` too: one tiny all-gather tells every rank the group's ranks and checks that all pass
    the same group_size, then a new_group per subgroup. Returns (this rank's subgroup, all the subgroups)."""
    world = _group(None, "new_subgroups")
    pg = None if group is GroupMember.NON_GROUP_MEMBER else _group(group, "new_subgroups")
    size = backend_module.local_rank_count() if group_size is None else group_size
    if not backend_module.is_int(size):
        raise TypeError(f"new_subgroups: group_size must be an integer, got {size!r}")
    table = C.ring_all_gather(world.comm, np.array([size, -1 if pg is None else pg.rank()], np.int64),
                              total=2 * world.size()).reshape(world.size(), 2)
    if len(set(table[:, 0].tolist())) > 1:
        cause = "the nodes hold different numbers of ranks" if group_size is None else "the ranks disagree"
        raise ValueError(f"new_subgroups: {cause}: group_size {table[:, 0].tolist()} on ranks 0..{world.size() - 1}; "
                         f"pass one group_size on every rank")
    ranks = [q for _, q in sorted((int(g), q) for q, g in enumerate(table[:, 1]) if g >= 0)]   # in group order
    if size <= 0:
        raise ValueError(f"new_subgroups: The arg 'group_size' ({size}) must be positive")
    if len(ranks) < size:
        raise ValueError(f"new_subgroups: The arg 'group_size' ({size}) must not exceed the world size ({len(ranks)})")
    if len(ranks) % size:
        raise ValueError(f"new_subgroups: The world size ({len(ranks)}) must be divisible by 'group_size={size}'")
    return new_subgroups_by_enumeration([ranks[i:i + size] for i in range(0, len(ranks), size)], timeout, backend,
                                        pg_options, group_desc)


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None,
                                 group_desc=None):
    """A new_group for each list of global ranks (no rank in two; a rank may be in none). Every rank of the
    world calls it. Returns (this rank's subgroup, or None; all the subgroups)."""
    if not ranks_per_subgroup_list:
        raise ValueError("new_subgroups_by_enumeration: The arg 'ranks_per_subgroup_list' cannot be empty")
    seen = {}
    for ranks in ranks_per_subgroup_list:
        for rank in ranks:
            if rank in seen:
                raise ValueError(f"new_subgroups_by_enumeration: Rank {rank} has appeared in both subgroup "
                                 f"{seen[rank]} and {ranks}")
            seen[rank] = ranks
    subgroups = [new_group(ranks, timeout, backend, pg_options, group_desc=group_desc)
                 for ranks in ranks_per_subgroup_list]
    mine = [g for g in subgroups if g is not GroupMember.NON_GROUP_MEMBER]
    return (mine[0] if mine else None), subgroups


def get_rank(group=None):
    return -1 if group is GroupMember.NON_GROUP_MEMBER else _group(group, "get_rank").rank()


def get_world_size(group=None):
    return -1 if group is GroupMember.NON_GROUP_MEMBER else _group(group, "get_world_size").size()


def _member(pg, name):
    """The group a question is about; a rank outside it cannot ask (PyTorch's answers there are not its own)."""
    if pg is GroupMember.NON_GROUP_MEMBER and _world is not None:
        raise ValueError(f"{name}: global rank {_world.comm.rank} is not in this group (new_group returned "
                         f"GroupMember.NON_GROUP_MEMBER here)")
    return _group(pg, name)


def get_backend(group=None):
    return _member(group, "get_backend").backend


def get_process_group_ranks(group):
    return list(_member(group, "get_process_group_ranks").ranks)


def get_global_rank(group, group_rank):
    pg = _member(group, "get_global_rank")
    if not 0 <= group_rank < pg.size():
        raise ValueError(f"get_global_rank: group rank {group_rank} is not in the group {pg.ranks}")
    return pg.ranks[group_rank]


def get_group_rank(group, global_rank):
    pg = _member(group, "get_group_rank")
    if global_rank not in pg.ranks:
        raise ValueError(f"get_group_rank: global rank {global_rank} is not in the group {pg.ranks}")
    return pg.ranks.index(global_rank)

"""torch.distributed's object collectives: any picklable Python objects, as PyTorch's all_gather_object,
broadcast_object_list and gather_object move them (pickle, as PyTorch's: only for objects from ranks you trust).

Each object is pickled into a uint8 array; the arrays' lengths differ, so all_gather_object gathers the lengths
first and then the bytes (comm's ring all-gather of uneven shards), and broadcast_object_list broadcasts the
length, then the bytes. The tensors' own calls (collectives.py) never pickle."""
import pickle

import numpy as np

from .. import comm as C
from .collectives import _only_at_root, _peer
from .groups import _group


def _pickled(obj):
    return np.frombuffer(pickle.dumps(obj), np.uint8)


def all_gather_object(object_list, obj, group=None):
    """object_list[i] = rank i's ``obj`` (object_list: one slot per rank of the group, filled in place)."""
    pg = _group(group, "all_gather_object")
    if pg is None:
        return None
    if len(object_list) != pg.size():
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} slots for a group of {pg.size()}")
    mine = _pickled(obj)
    lengths = C.ring_all_gather(pg.comm, np.array([mine.size], np.int64), total=pg.size())
    whole = C.ring_all_gather(pg.comm, mine)                  # uneven shards: their lengths exchanged again
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(pg.size()):
        object_list[i] = pickle.loads(whole[starts[i]:starts[i + 1]].tobytes())


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    """The destination's object_gather_list[i] = rank i's ``obj`` (through all_gather_object, as gather goes
    through all_gather); the other ranks pass None."""
    pg = _group(group, "gather_object")
    if pg is None:
        return None
    root = _peer(pg, "gather_object", dst, group_dst, "dst")
    _only_at_root(pg, "gather_object", root, object_gather_list, "object_gather_list", "destination")
    all_gather_object(object_gather_list if object_gather_list is not None else [None] * pg.size(), obj, pg)


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    """Every rank's object_list (in place) = the source's; the lists are as long on every rank."""
    pg = _group(group, "broadcast_object_list")
    if pg is None:
        return None
    root = _peer(pg, "broadcast_object_list", src, group_src, "src")
    data = _pickled(list(object_list)) if pg.rank() == root else None
    length = np.array([0 if data is None else data.size], np.int64)
    C.broadcast(pg.comm, length, root=root)
    if data is None:
        data = np.empty(int(length[0]), np.uint8)
    C.broadcast(pg.comm, data, root=root)
    objects = pickle.loads(data.tobytes())
    if len(objects) != len(object_list):
        raise ValueError(f"[rank {pg.comm.rank}] broadcast_object_list: rank {pg.ranks[root]} sent {len(objects)} "
                         f"objects into a list of {len(object_list)} here (the lists must be as long on every rank)")
    object_list[:] = objects

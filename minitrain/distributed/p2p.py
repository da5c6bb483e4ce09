"""torch.distributed's point-to-point calls: send / recv / isend / irecv, and P2POp + batch_isend_irecv, each
message one of comm's isend / irecv (MPI_Isend / MPI_Irecv under gloo and mpi: the bytes of the tensor, once).

batch_isend_irecv checks every op, then posts them all before any is waited on, so the order of sends and
receives in the list cannot deadlock: a ring exchange (send right, receive left, Megatron's pipeline
exchange) runs at any p, p = 1 included. Messages between one pair in one direction match in the order
posted (MPI's non-overtaking rule), as PyTorch requires. In a batch, a message to oneself is a copy into
the receive from oneself with the same tag (NCCL's batch allows it; gloo's fails); a lone isend to oneself is
refused, as send's is.
"""
import numbers

from ..comm.communicator import USER_TAG_LIMIT
from . import groups
from .collectives import _array, _peer
from .groups import _group


def _message(name, tensor, group, tag, peer, group_peer, what):
    """(group, array, the peer's rank in the group) of one message, or None off the group: everything that
    could refuse it checked before anything is posted."""
    pg = _group(group, name)
    if pg is None:
        return None
    if what == "src" and peer is None and group_peer is None:
        raise ValueError(f"{name}: a receive from any source (src=None) is not supported here: name the sender")
    rank, x = _peer(pg, name, peer, group_peer, what), _array(tensor, name)
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: the tensor must be contiguous (it is sent or received in place)")
    if what == "src" and not getattr(x.flags, "writeable", True):
        raise ValueError(f"[rank {pg.ranks[pg.rank()]}] {name}: tensor is read-only, and the receive writes into it")
    if not (isinstance(tag, numbers.Integral) and 0 <= tag < USER_TAG_LIMIT):
        raise ValueError(f"{name}: tag {tag!r} is not an integer in 0..{USER_TAG_LIMIT - 1} (tags above are the "
                         f"collectives')")
    return pg, x, rank


def _not_self(pg, name, peer, what):
    if peer == pg.rank():
        raise ValueError(f"{name}: Invalid {what} rank: should not be the same as rank of the current process")
    return peer


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    message = _message("isend", tensor, group, tag, dst, group_dst, "dst")
    if message is None:
        return None
    pg, x, peer = message
    return pg.comm.isend(x, _not_self(pg, "isend", peer, "destination"), tag)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    message = _message("irecv", tensor, group, tag, src, group_src, "src")
    if message is None:
        return None
    pg, x, peer = message
    return pg.comm.irecv(x, _not_self(pg, "irecv", peer, "source"), tag)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """Receive into ``tensor``; returns the sender's global rank (-1 off the group), as PyTorch does."""
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    work.wait()
    pg = groups._world if group is None else group
    return src if src is not None else pg.ranks[group_src]


class P2POp:
    """One message of a batch_isend_irecv: ``op`` (dist.isend or dist.irecv), the tensor, the peer as a global
    rank (``peer``) or a rank in ``group`` (``group_peer``; group None: the world), and the tag."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        if op is not isend and op is not irecv:
            raise ValueError(f"P2POp: op must be dist.isend or dist.irecv, got {getattr(op, '__name__', op)!r}")
        _array(tensor, "P2POp")
        self.op, self.tensor, self.tag = op, tensor, tag
        if group is groups.GroupMember.NON_GROUP_MEMBER:
            self.group, self.peer, self.group_peer = group, peer, group_peer   # batch_isend_irecv: nothing to do
        else:
            self.group = _group(group, "P2POp")
            self.group_peer = _peer(self.group, "P2POp", peer, group_peer, "peer")
            self.peer = self.group.ranks[self.group_peer]

    def __repr__(self):
        return f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


class _Copied:
    """The Work of a message to oneself: done when the batch returns (a copy)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def batch_isend_irecv(p2p_op_list):
    """Post every op of ``p2p_op_list`` (one group for all) and return their Works, in the list's order;
    off the group, [] (with PyTorch's warning)."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(op, P2POp) for op in p2p_op_list):
        raise ValueError(f"batch_isend_irecv: p2p_op_list must be a list of dist.P2POp, got "
                         f"{type(p2p_op_list).__name__} {p2p_op_list!r:.80}")
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list is empty; give it at least one P2POp")
    group = p2p_op_list[0].group
    if any(op.group is not group for op in p2p_op_list):
        raise ValueError("batch_isend_irecv: All ops need to use the same group (each P2POp's group=)")
    if _group(group, "batch_isend_irecv") is None:
        return []
    messages = [_message(op.op.__name__, op.tensor, group, op.tag, None, op.group_peer,
                         "dst" if op.op is isend else "src") for op in p2p_op_list]
    copies = _copies_to_self(group, p2p_op_list, messages)
    post = {isend: group.comm.isend, irecv: group.comm.irecv}
    works = [None if peer == group.rank() else post[op.op](x, peer, op.tag)
             for op, (_, x, peer) in zip(p2p_op_list, messages)]
    for receive, sent in copies.items():
        x = messages[receive][1]
        x[...] = messages[sent][1].reshape(x.shape)
    return [_Copied() if work is None else work for work in works]


def _copies_to_self(pg, ops, messages):
    """{index of a receive from oneself: index of its send}, paired by tag in the order given; a message to
    oneself without its partner in the batch, or of another size or dtype, is refused."""
    pending, copies = {}, {}
    for i, (op, (_, x, peer)) in enumerate(zip(ops, messages)):
        if peer == pg.rank() and op.op is isend:
            pending.setdefault(op.tag, []).append(i)
    for i, (op, (_, x, peer)) in enumerate(zip(ops, messages)):
        if peer != pg.rank() or op.op is isend:
            continue
        if not pending.get(op.tag):
            raise ValueError(f"batch_isend_irecv: an irecv from this rank itself (tag {op.tag}) needs an isend to "
                             f"itself with the same tag in the same batch")
        sent = messages[pending[op.tag][0]][1]
        if sent.dtype != x.dtype or sent.size != x.size:
            raise ValueError(f"batch_isend_irecv: the message to itself (tag {op.tag}) has {sent.size} elements of "
                             f"{sent.dtype}, its irecv {x.size} of {x.dtype}")
        copies[i] = pending[op.tag].pop(0)
    unpaired = [i for sends in pending.values() for i in sends]
    if unpaired:
        raise ValueError(f"batch_isend_irecv: an isend to this rank itself (tag {ops[unpaired[0]].tag}) needs an "
                         f"irecv from itself with the same tag in the same batch")
    return copies

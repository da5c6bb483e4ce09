"""What a communication call raises: one small module that the core, the guard and every backend share."""


class CommError(RuntimeError):
    """A communication call was used wrongly (bad peer, bad buffer, size or dtype mismatch)."""


class CollectiveTimeout(CommError):
    """A wait ran past the hard timeout: some peer never answered."""


class CollectiveMismatchError(CommError):
    """Ranks called different collectives, or the same one with different arguments."""


class Unavailable(CommError):
    """A backend or transport asked for cannot work here (raised on every rank alike)."""


class RankFailedError(CommError):
    """Another rank failed, so this one stopped waiting for it."""


class MessageTruncated(Exception):
    """Raised by a transport's ``test()``: the incoming message is longer than the buffer."""


def size_error(comm, request, received, their_dtype=None):
    """The receive contract's error: both ranks, the call (collective and number, or the p2p tag), both
    sizes, and what the guard adds (what the sender called: reports.sender_note)."""
    buf, peer, call = request.buf, request.peer, comm._call()
    where = (f"{call.name} #{call.seq}" + ("" if comm.uid == "world" else f" on {comm.uid}") if call else
             f"recv from rank {peer} (tag {request.tag})")
    theirs = f"{received} bytes" if received is not None else f"more than the {buf.nbytes} bytes that fit"
    theirs += "" if their_dtype is None else f" of {their_dtype}"
    return (CommError if call is None else CollectiveMismatchError)(
        f"[rank {comm.rank}] {where}: the message from rank {peer} has {theirs}, but rank {comm.rank} expected "
        f"{buf.nbytes} bytes ({buf.dtype.name}, shape {tuple(buf.shape)})" + comm.guard.size_note(comm, request, call))

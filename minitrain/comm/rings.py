"""The ring collectives (Patarasuk & Yuan 2009): reduce-scatter, all-gather, and all-reduce as the
two in turn. p ranks, N elements of b bytes; per rank (what comm.stats measures):

  ring_reduce_scatter   (p-1) messages, (N - |own chunk|)·b         ~ (p-1)/p·N·b
  ring_all_gather       (p-1) messages, (N - |chunk r+1|)·b         ~ (p-1)/p·N·b
  ring_all_reduce       both of the above: 2(p-1)·alpha + 2(p-1)/p·N·b·beta   (bandwidth-optimal)

Chunks follow np.array_split(x.ravel(), p), so any length works. Each returns a new array (or
fills out=) and leaves the input untouched; async_op=True returns a Work (work.py).
"""
import numpy as np

from ..backend import array_module
from .reductions import check_array, check_op, check_out, chunk_bounds, combine, finish_mean, flat_view, output_buffer


def _sendrecv_reduce(comm, sendbuf, dest, recvbuf, source, tag, own, op):
    """One reduce-scatter step: send ``sendbuf``, and make ``recvbuf`` = what arrives (op) ``own``.
    A transport that reads the peer's memory (CUDA IPC) reduces as it reads: one kernel, no copy."""
    recv = comm.irecv(recvbuf, source, tag)
    fused = recv.reduce_on_arrival(own, op)
    send = comm.isend(sendbuf, dest, tag)
    comm.wait_all([recv, send], f"sendrecv (to rank {dest}, from rank {source})")
    if not fused:
        combine(recvbuf, own, op)


def ring_all_reduce(comm, x, op="sum", out=None, async_op=False):
    """Every rank gets the reduction of all ranks' ``x`` (same shape everywhere): ring
    reduce-scatter then ring all-gather. 2(p-1) steps; 2(p-1)/p·N·b bytes sent per rank.
    Returns a new array, or fills ``out`` (reuse one buffer across steps: no page faults)."""
    check_array(comm, x, "ring_all_reduce")
    check_op(comm, "ring_all_reduce", op, x.dtype)
    check_out(comm, "ring_all_reduce", out, x.shape, x)

    def ring(comm, tag):
        p, r = comm.size, comm.rank
        right, left = (r + 1) % p, (r - 1) % p
        flat = flat_view(x)
        result = output_buffer(out, flat, flat.size)
        bounds = chunk_bounds(flat.size, p)

        def own(i):                       # chunk i of this rank's input, and of the result
            return flat[bounds[i]:bounds[i + 1]]

        def res(i):
            return result[bounds[i]:bounds[i + 1]]
        if p == 1:
            result[...] = flat
        # reduce-scatter: at step s send chunk r-s-1 (my input at first, then what I reduced last step),
        # receive chunk r-s-2 and add my input's copy to it; after p-1 steps chunk r is fully reduced here
        for step in range(p - 1):
            send_i, recv_i = (r - step - 1) % p, (r - step - 2) % p
            outgoing = own(send_i) if step == 0 else res(send_i)
            _sendrecv_reduce(comm, outgoing, right, res(recv_i), left, tag, own(recv_i), op)
        finish_mean(res(r), op, p)
        # all-gather: pass the reduced chunks around the ring; after p-1 steps every rank has all of them
        for step in range(p - 1):
            send_i, recv_i = (r - step) % p, (r - step - 1) % p
            comm.sendrecv(res(send_i), right, res(recv_i), left, tag)
        return out if out is not None else result.reshape(x.shape)
    header = {"shape": x.shape, "dtype": x.dtype, "op": op}
    return comm.launch("ring_all_reduce", ring, (), async_op, header, x.nbytes)


def ring_reduce_scatter(comm, x, op="sum", out=None, bounds=None, async_op=False):
    """Rank r gets chunk r (``np.array_split(x.ravel(), p)[r]``) of the reduction of all ranks' x.
    (p-1) steps; (N - |chunk r|)·b bytes sent per rank; working memory two chunks.
    ``bounds`` (p+1 offsets) gives another partition: chunk r = [bounds[r], bounds[r+1]) (as
    MPI_Reduce_scatter's counts; ZeRO-2 uses it for the slices of a bucket each rank owns)."""
    check_array(comm, x, "ring_reduce_scatter")
    check_op(comm, "ring_reduce_scatter", op, x.dtype)
    _check_bounds(comm, bounds, x.size)
    bounds = chunk_bounds(x.size, comm.size) if bounds is None else list(bounds)
    check_out(comm, "ring_reduce_scatter", out, (bounds[comm.rank + 1] - bounds[comm.rank],), x)

    def ring(comm, tag):
        p, r = comm.size, comm.rank
        right, left = (r + 1) % p, (r - 1) % p
        flat = flat_view(x)
        result = output_buffer(out, flat, bounds[r + 1] - bounds[r])

        def own(i):                       # chunk i of this rank's input
            return flat[bounds[i]:bounds[i + 1]]
        if p == 1:
            result[...] = flat
        # two chunk-sized buffers in turn (receive into one while the other is sent); the last step,
        # which brings chunk r itself, receives straight into the result
        largest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        scratch = [array_module(flat).empty(largest, flat.dtype) for _ in range(2)] if p > 1 else None
        reduced = None
        for step in range(p - 1):     # as in ring_all_reduce: send chunk r-s-1, receive and reduce chunk r-s-2
            send_i, recv_i = (r - step - 1) % p, (r - step - 2) % p
            incoming = result if step == p - 2 else scratch[step % 2][:bounds[recv_i + 1] - bounds[recv_i]]
            _sendrecv_reduce(comm, own(send_i) if step == 0 else reduced, right, incoming, left, tag, own(recv_i), op)
            reduced = incoming
        finish_mean(result, op, p)
        return out if out is not None else result
    header = {"shape": x.shape, "dtype": x.dtype, "op": op}
    return comm.launch("ring_reduce_scatter", ring, (), async_op, header, x.nbytes)


def _check_bounds(comm, bounds, n):
    if bounds is not None and (len(bounds) != comm.size + 1 or bounds[0] != 0 or bounds[-1] != n
                               or any(b < a for a, b in zip(bounds[:-1], bounds[1:]))):
        raise ValueError(f"ring_reduce_scatter: bounds must be {comm.size + 1} non-decreasing offsets "
                         f"from 0 to {n}, got {list(bounds)}")


def ring_all_gather(comm, shard, total=None, out=None, async_op=False):
    """Concatenation of every rank's (flat) shard, in rank order. Shards may differ in length
    (as np.array_split makes them); pass ``total`` when the full length is known, otherwise the
    lengths are exchanged first (``out`` then needs ``total``). (p-1) steps; (N - |chunk r+1|)·b
    bytes sent per rank."""
    check_array(comm, shard, "ring_all_gather")
    _check_gather(comm, shard, total, out)

    def ring(comm, tag):
        p, r = comm.size, comm.rank
        flat = flat_view(shard)
        if total is None:                 # lengths unknown: gather them first (p-1 tiny messages)
            lengths = np.empty(p, np.int64)
            lengths[r] = flat.size
            _pass_around(comm, tag, lengths, list(range(p + 1)))
            bounds = [0] + np.cumsum(lengths).tolist()
        else:
            bounds = chunk_bounds(total, p)
        result = output_buffer(out, flat, bounds[-1])
        result[bounds[r]:bounds[r + 1]] = flat
        _pass_around(comm, tag, result, bounds)
        return out if out is not None else result
    header = {"shape": None, "dtype": shard.dtype, "extra": -1 if total is None else total}
    return comm.launch("ring_all_gather", ring, (), async_op, header, shard.nbytes)


def _pass_around(comm, tag, out, bounds):
    """The all-gather's ring: at step s send chunk r-s, receive chunk r-s-1 from the left."""
    p, r = comm.size, comm.rank
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        comm.sendrecv(out[bounds[send_i]:bounds[send_i + 1]], (r + 1) % p,
                      out[bounds[recv_i]:bounds[recv_i + 1]], (r - 1) % p, tag)


def _check_gather(comm, shard, total, out):
    if out is not None and total is None:
        raise ValueError(f"[rank {comm.rank}] ring_all_gather: out= needs total= (the length of the result)")
    if total is not None:
        bounds = chunk_bounds(total, comm.size)
        if bounds[comm.rank + 1] - bounds[comm.rank] != shard.size:
            raise ValueError(f"[rank {comm.rank}] ring_all_gather: shard of {shard.size} elements, but "
                             f"np.array_split of {total} over {comm.size} gives this rank "
                             f"{bounds[comm.rank + 1] - bounds[comm.rank]}")
    check_out(comm, "ring_all_gather", out, (total,) if total is not None else (), shard)

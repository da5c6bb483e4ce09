"""Hand-written collectives on the Communicator's point-to-point calls (Thakur et al. 2005;
Patarasuk & Yuan 2009 for the ring). MPI's built-ins are the oracle and the speed anchor only.

Cost model: sending n bytes costs alpha + n·beta. p ranks, N elements of the input, b bytes
each. Per rank (what comm.stats measures):

  ring_reduce_scatter   (p-1) messages, (N - |own chunk|)·b         ~ (p-1)/p·N·b
  ring_all_gather       (p-1) messages, (N - |chunk r+1|)·b         ~ (p-1)/p·N·b
  ring_all_reduce       both of the above: 2(p-1)·alpha + 2(p-1)/p·N·b·beta   (bandwidth-optimal)
  recursive_doubling    log2(p) messages of N·b: log2(p)·(alpha + N·b·beta)   (latency-optimal)
  naive_all_reduce      root receives and sends (p-1)·N·b: 2(p-1)·(alpha + N·b·beta) at the root
  broadcast / reduce    binomial tree: ceil(log2 p)·(alpha + N·b·beta) on the critical path
  all_to_all            (p-1) messages of N/p·b: (p-1)·alpha + (p-1)/p·N·b·beta

Arrays of any shape are treated as flat; chunks follow np.array_split(x.ravel(), p), so any
length works (0, 1, fewer than p, not divisible by p). op is sum, mean, max, min or prod
(PyTorch's AVG is mean: floating dtypes only, since an integer mean is not an integer; its PRODUCT
is prod). ring_all_reduce and friends return new arrays and leave the input untouched; broadcast
fills the receivers' buffers in place, like MPI_Bcast. async_op=True returns a Work (see work.py).
"""
import operator

import numpy as np

from ..backend import array_module
from .errors import CommError
from .reductions import check_array, check_op, check_out, combine, finish_mean, flat_view, output_buffer
from .rings import ring_all_gather, ring_all_reduce

# all_reduce(algorithm="auto") uses recursive doubling below AUTO_CROSSOVER_BYTES·p/2 and the ring
# above. Measured by scripts/bench_collectives.py on the 2-core machine: the crossover was 64 KiB
# at p=2 and 128-256 KiB at p=4. It grows with p because the ring's latency term, 2(p-1)·alpha,
# outgrows recursive doubling's log2(p)·alpha.
AUTO_CROSSOVER_BYTES = 64 * 1024


# ---------------------------------------------------------------- trees
def _broadcast_body(comm, tag, x, root):
    p = comm.size
    vrank = (comm.rank - root) % p           # rank relative to the root
    flat = x.reshape(-1)
    mask = 1
    while mask < p:                          # round k: ranks [0, 2^k) send to [2^k, 2^(k+1))
        if vrank < mask:
            child = vrank + mask
            if child < p:
                comm.send(flat, (child + root) % p, tag)
        elif vrank < 2 * mask:
            comm.recv(flat, (vrank - mask + root) % p, tag)
        mask <<= 1
    return x


def broadcast(comm, x, root=0, async_op=False):
    """Copy root's ``x`` into every rank's ``x`` (in place; every rank passes a buffer of the same
    shape and dtype) along a binomial tree: ceil(log2 p) rounds."""
    check_array(comm, x, "broadcast")
    if not 0 <= root < comm.size:
        raise ValueError(f"[rank {comm.rank}] broadcast: root {root} is not in a world of size {comm.size}")
    if not x.flags.c_contiguous:
        raise ValueError(f"[rank {comm.rank}] broadcast: the buffer must be contiguous (it is filled in place)")
    if comm.rank != root and not getattr(x.flags, "writeable", True):
        raise ValueError(f"[rank {comm.rank}] broadcast: the buffer is read-only (every rank but the root's is "
                         f"filled in place)")
    header = {"shape": x.shape, "dtype": x.dtype, "extra": root}
    return comm.launch("broadcast", _broadcast_body, (x, root), async_op, header, x.nbytes)


def _reduce_body(comm, tag, x, root, op):
    p = comm.size
    vrank = (comm.rank - root) % p
    acc = flat_view(x).copy()
    incoming = array_module(acc).empty_like(acc)
    mask = 1
    while mask < p:                          # mirror image of the broadcast tree
        if vrank & mask:
            comm.send(acc, (vrank - mask + root) % p, tag)
            return None
        child = vrank + mask
        if child < p:
            comm.recv(incoming, (child + root) % p, tag)
            combine(acc, incoming, op)
        mask <<= 1
    finish_mean(acc, op, p)
    return acc.reshape(x.shape)


def reduce(comm, x, root=0, op="sum", async_op=False):
    """The reduction of all ranks' ``x`` on ``root`` (None on the others), along a binomial tree."""
    check_array(comm, x, "reduce")
    check_op(comm, "reduce", op, x.dtype)
    if not 0 <= root < comm.size:
        raise ValueError(f"[rank {comm.rank}] reduce: root {root} is not in a world of size {comm.size}")
    header = {"shape": x.shape, "dtype": x.dtype, "op": op, "extra": root}
    return comm.launch("reduce", _reduce_body, (x, root, op), async_op, header, x.nbytes)


# ---------------------------------------------------------------- the contrast and the latency-bound case
def _naive_body(comm, tag, x, op, root, result):
    flat = flat_view(x)
    out = output_buffer(result, flat, flat.size)
    out[...] = flat
    if comm.rank == root:
        incoming = array_module(flat).empty_like(flat)
        for peer in range(comm.size):
            if peer != root:
                comm.recv(incoming, peer, tag)
                combine(out, incoming, op)
        finish_mean(out, op, comm.size)
        for peer in range(comm.size):
            if peer != root:
                comm.send(out, peer, tag)
    else:
        comm.send(flat, root, tag)
        comm.recv(out, root, tag)
    return result if result is not None else out.reshape(x.shape)


def naive_all_reduce(comm, x, op="sum", root=0, out=None, async_op=False):
    """Everyone sends everything to the root, which reduces and sends the result back to each:
    the root moves 2(p-1)·N·b bytes, serially. The contrast that motivates the ring."""
    check_array(comm, x, "naive_all_reduce")
    check_op(comm, "naive_all_reduce", op, x.dtype)
    if not 0 <= root < comm.size:
        raise ValueError(f"[rank {comm.rank}] naive_all_reduce: root {root} is not in a world of size {comm.size}")
    check_out(comm, "naive_all_reduce", out, x.shape, x)
    header = {"shape": x.shape, "dtype": x.dtype, "op": op, "extra": root}
    return comm.launch("naive_all_reduce", _naive_body, (x, op, root, out), async_op, header, x.nbytes)


def _recursive_doubling_body(comm, tag, x, op, out):
    p, r = comm.size, comm.rank
    flat = flat_view(x)
    acc = output_buffer(out, flat, flat.size)
    acc[...] = flat
    incoming = array_module(acc).empty_like(acc)
    pow2 = 1
    while pow2 * 2 <= p:
        pow2 *= 2
    extra = p - pow2
    # fold the ranks beyond the largest power of two into their partners r - pow2
    if r >= pow2:
        comm.send(acc, r - pow2, tag)
        comm.recv(acc, r - pow2, tag)
        return out if out is not None else acc.reshape(x.shape)
    if r < extra:
        comm.recv(incoming, r + pow2, tag)
        combine(acc, incoming, op)
    mask = 1
    while mask < pow2:                       # exchange whole vectors with the partner r XOR mask
        partner = r ^ mask
        comm.sendrecv(acc, partner, incoming, partner, tag)
        combine(acc, incoming, op)          # a+b == b+a in IEEE arithmetic: partners stay bit-identical
        mask <<= 1
    finish_mean(acc, op, p)
    if r < extra:
        comm.send(acc, r + pow2, tag)
    return out if out is not None else acc.reshape(x.shape)


def recursive_doubling_all_reduce(comm, x, op="sum", out=None, async_op=False):
    """log2(p) rounds, each exchanging the whole vector with the partner rank r XOR 2^k; ranks
    beyond the largest power of two fold in first and get the result last. Few messages, many
    bytes: the right choice for small messages, where latency (alpha) dominates."""
    check_array(comm, x, "recursive_doubling_all_reduce")
    check_op(comm, "recursive_doubling_all_reduce", op, x.dtype)
    check_out(comm, "recursive_doubling_all_reduce", out, x.shape, x)
    header = {"shape": x.shape, "dtype": x.dtype, "op": op}
    return comm.launch("recursive_doubling_all_reduce", _recursive_doubling_body, (x, op, out), async_op,
                   header, x.nbytes)


def _all_to_all_body(comm, tag, x):
    p, r = comm.size, comm.rank
    blocks = flat_view(x).reshape(p, -1)
    out = array_module(blocks).empty_like(blocks)
    out[r] = blocks[r]
    for step in range(1, p):                 # pairwise exchange: send to r+step, hear from r-step
        dest, source = (r + step) % p, (r - step) % p
        comm.sendrecv(blocks[dest], dest, out[source], source, tag)
    return out.reshape(x.shape)


def all_to_all(comm, x, async_op=False):
    """Block j of ``x`` (x split into p equal blocks along axis 0) goes to rank j; block j of the
    result came from rank j (MPI_Alltoall). (p-1) messages of N/p elements per rank."""
    check_array(comm, x, "all_to_all")
    if x.ndim == 0 or x.shape[0] % comm.size:
        raise ValueError(f"[rank {comm.rank}] all_to_all: the first axis ({x.shape[:1]}) must divide into "
                         f"{comm.size} equal blocks")
    header = {"shape": x.shape, "dtype": x.dtype}
    return comm.launch("all_to_all", _all_to_all_body, (x,), async_op, header, x.nbytes)


# ---------------------------------------------------------------- agreement: barrier, split
def _barrier_body(comm, tag):
    token, incoming = np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    distance = 1
    while distance < comm.size:
        comm.sendrecv(token, (comm.rank + distance) % comm.size, incoming, (comm.rank - distance) % comm.size, tag)
        distance *= 2


def barrier(comm):
    """Dissemination barrier (Hensgen et al. 1988): ceil(log2 p) rounds of empty messages."""
    comm.launch("barrier", _barrier_body, (), False, {}, 0)


def split_table(comm, color, key):
    """Every rank's (color, key) through one timed all-gather, so that no rank can wait for a split
    another never calls (Communicator.split). Returns (this rank's new members in world ranks, its
    new rank, the new communicator's uid). Every rank joins one group (MPI_Comm_split without
    MPI_UNDEFINED): a color or key that is not an integer (None; 1.5, which int() would cut) is refused."""
    for what, value in (("color", color), ("key", key)):
        try:
            operator.index(value)
        except TypeError:
            raise CommError(f"[rank {comm.rank}] split: {what} must be an integer, got {value!r} (every rank joins "
                            f"one group: a rank that needs none passes a color of its own)") from None
    table = ring_all_gather(comm, np.array([color, key], np.int64), total=2 * comm.size).reshape(comm.size, 2)
    local = [r for _, r in sorted((int(k), r) for r, (c, k) in enumerate(table) if c == color)]
    world = [comm.members[r] for r in local]
    return world, local.index(comm.rank), f"{comm.uid}/split{comm._splits}{world}"


# ---------------------------------------------------------------- the dispatcher
COLLECTIVE_NAMES = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast", "reduce",
                    "naive_all_reduce", "recursive_doubling_all_reduce", "all_to_all", "all_to_all_single", "barrier")
ALGORITHMS = {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce,
              "naive": naive_all_reduce}
ALL_REDUCE_ALGORITHMS = ("ring", "recursive_doubling", "naive", "auto")


def check_algorithm(algorithm, who="all_reduce"):
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"{who}: unknown all-reduce algorithm {algorithm!r}: expected one of {ALL_REDUCE_ALGORITHMS}")
    return algorithm


def all_reduce(comm, x, op="sum", algorithm="auto", out=None, async_op=False):
    """All-reduce choosing the algorithm: ``auto`` takes recursive doubling for small messages
    (latency-bound: below AUTO_CROSSOVER_BYTES·p/2) and the ring above (bandwidth-bound).
    ``out`` receives the result in a buffer the caller reuses (every algorithm, async too)."""
    check_array(comm, x, "all_reduce")
    check_algorithm(algorithm)
    if algorithm == "auto":
        small = x.nbytes < AUTO_CROSSOVER_BYTES * max(1, comm.size // 2)
        algorithm = "recursive_doubling" if small else "ring"
    return ALGORITHMS[algorithm](comm, x, op=op, out=out, async_op=async_op)


def all_reduce_coalesced(comm, arrays, op="sum", algorithm="auto"):
    """All-reduce several arrays as one message, in place (torch.distributed.all_reduce_coalesced):
    flatten them into one buffer, all-reduce it once (one alpha instead of one per array), copy each
    array's part back. The arrays may differ in shape, not in dtype or device."""
    arrays = list(arrays)
    if not arrays:
        return arrays
    for a in arrays:
        check_array(comm, a, "all_reduce_coalesced")
    if len({a.dtype for a in arrays}) != 1:
        raise TypeError(f"[rank {comm.rank}] all_reduce_coalesced: one dtype per call, got "
                        f"{sorted({str(a.dtype) for a in arrays})}")
    xp = array_module(arrays[0])
    reduced = all_reduce(comm, xp.concatenate([a.reshape(-1) for a in arrays]), op=op, algorithm=algorithm)
    offset = 0
    for a in arrays:
        a[...] = reduced[offset:offset + a.size].reshape(a.shape)
        offset += a.size
    return arrays

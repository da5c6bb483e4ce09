"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", sec. 3, Figure 2).

Each of p ranks holds a contiguous T/p of the sequence, with every head. Around the attention, an
all-to-all turns that into all T positions of H/p heads (seq_to_heads): each head's attention is
then the ordinary causal attention over the whole sequence, and a second all-to-all gives every
rank its sequence chunk of every head back (heads_to_seq). Backward runs the reverse all-to-alls.
Per rank and layer, with a tensor of B·H·(T/p)·D numbers: 4 all-to-alls forward (q, k, v, the
output) and 4 backward, each sending (p-1)/p of it: 8·(p-1)/p·B·(T/p)·H·D numbers. The heads
must divide by p (by p·t under t-way tensor parallelism, which already took H/t of them).
"""
from ...autograd import Function
from ...backend import array_module
from ...comm import all_to_all_single


def check_heads(heads, comm):
    """One clear error unless this rank's ``heads`` split over the ``comm.size`` Ulysses ranks."""
    if heads % comm.size:
        raise ValueError(f"[rank {comm.rank}] Ulysses: {heads} attention heads on this rank do not divide by "
                         f"cp = {comm.size} (each rank attends with whole heads: n_head must divide by cp·tp)")


def seq_to_heads(comm, x):
    """(B, H, T/p, D) -- this rank's sequence chunk of every head -> (B, H/p, T, D): the whole
    sequence of heads [r·H/p, (r+1)·H/p). One all_to_all_single."""
    xp = array_module(x)
    p = comm.size
    B, H, t, D = x.shape
    check_heads(H, comm)
    rows = xp.ascontiguousarray(xp.moveaxis(x, 1, 0))                 # (H, B, t, D): head block j -> rank j
    got = all_to_all_single(comm, rows)                                # (p·H/p, B, t, D): rank i's chunk i
    got = got.reshape(p, H // p, B, t, D)
    return xp.ascontiguousarray(got.transpose(2, 1, 0, 3, 4).reshape(B, H // p, p * t, D))


def heads_to_seq(comm, y):
    """(B, H/p, T, D) -> (B, H, T/p, D): seq_to_heads undone. One all_to_all_single."""
    xp = array_module(y)
    p = comm.size
    B, h, T, D = y.shape
    t = T // p
    rows = xp.ascontiguousarray(y.reshape(B, h, p, t, D).transpose(2, 1, 0, 3, 4))   # chunk i -> rank i
    got = all_to_all_single(comm, rows.reshape(p * h, B, t, D))        # (p·h, B, t, D): rank j's heads
    return xp.ascontiguousarray(xp.moveaxis(got, 0, 1))


class SeqToHeads(Function):
    """seq_to_heads forward, heads_to_seq of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return seq_to_heads(comm, x)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(ctx.comm, g), None


class HeadsToSeq(Function):
    """heads_to_seq forward, seq_to_heads of the gradient backward."""

    @staticmethod
    def forward(ctx, y, comm):
        ctx.comm = comm
        return heads_to_seq(comm, y)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(ctx.comm, g), None


def ulysses_attention(q, k, v, comm, attention):
    """``attention(q, k, v)`` -- any attention over the whole sequence, (B, h, T, D) -- on this rank's
    H/p heads, between the two all-to-alls: (B, H, T/p, D) in and out, the sequence cut contiguously."""
    q, k, v = (SeqToHeads.apply(a, comm) for a in (q, k, v))
    return HeadsToSeq.apply(attention(q, k, v), comm)

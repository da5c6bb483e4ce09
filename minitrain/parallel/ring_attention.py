"""Ring self-attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from System
Perspective"; the online softmax of Milakov & Gimelshein 2018 makes it exact).

The sequence is split across p ranks: rank r holds the queries, keys and values of positions
[r·T/p, (r+1)·T/p). No rank ever holds the (T, T) score matrix or all the keys. Forward: the
(K, V) blocks travel round the ring; at each of the p steps a rank scores its queries against the
block it holds and folds the result into a running maximum m, a running sum l and an unnormalised
output o:

    m' = max(m, rowmax S);   l = l·e^(m-m') + rowsum e^(S-m');   o = o·e^(m-m') + e^(S-m') V

and finally o / l: exactly softmax(S) V over the whole sequence. Causal masking: blocks from later
positions are skipped, the rank's own block gets the triangular mask.

Backward: the blocks go round again, this time with their gradient accumulators dK, dV riding along;
each rank adds its queries' contribution (recomputing the scores from the saved log-sum-exp), and
after p steps each block's accumulated dK, dV arrive back home. Per rank per direction: p block
exchanges of 2·(B·H·T/p·D) numbers (4 in backward, with the gradients).
"""
import math

from ..autograd import Function
from ..backend import array_module

_TAG = 7300


def _scores(q, k, scale, mask_kind, xp):
    s = (q @ xp.swapaxes(k, -1, -2)) * scale
    if mask_kind == "diagonal":
        t = s.shape[-1]
        s = xp.where(xp.triu(xp.ones((t, t), dtype=bool), k=1), -xp.inf, s)
    return s


def _mask_kind(my_block, their_block, causal):
    if not causal or their_block < my_block:
        return "none"
    return "diagonal" if their_block == my_block else "skip"


def _pass_on(comm, arrays, xp):
    """Send these arrays to rank r+1 and receive rank r-1's (a ring step)."""
    if comm.size == 1:
        return arrays
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    received = []
    for a in arrays:
        buf = xp.empty_like(a)
        comm.sendrecv(xp.ascontiguousarray(a), right, buf, left, sendtag=_TAG)
        received.append(buf)
    return received


class RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal=True):
        xp = array_module(q)
        p, r = comm.size, comm.rank
        scale = 1.0 / math.sqrt(q.shape[-1])
        m = xp.full(q.shape[:-1] + (1,), -xp.inf, dtype=q.dtype)
        l = xp.zeros(q.shape[:-1] + (1,), dtype=q.dtype)
        o = xp.zeros_like(q)
        kb, vb = k, v
        for step in range(p):
            block = (r - step) % p                          # whose keys and values we hold now
            kind = _mask_kind(r, block, causal)
            if kind != "skip":
                s = _scores(q, kb, scale, kind, xp)
                m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
                correction = xp.exp(m - m_new)
                e = xp.exp(s - m_new)
                l = l * correction + e.sum(axis=-1, keepdims=True)
                o = o * correction + e @ vb
                m = m_new
            if step < p - 1:
                kb, vb = _pass_on(comm, [kb, vb], xp)
        o = o / l
        ctx.save_for_backward(q, k, v, o, m + xp.log(l))
        ctx.comm, ctx.causal, ctx.scale = comm, causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        xp = array_module(q)
        comm, p, r = ctx.comm, ctx.comm.size, ctx.comm.rank
        delta = (do * o).sum(axis=-1, keepdims=True)
        dq = xp.zeros_like(q)
        kb, vb, dkb, dvb = k, v, xp.zeros_like(k), xp.zeros_like(v)
        for step in range(p):
            block = (r - step) % p
            kind = _mask_kind(r, block, ctx.causal)
            if kind != "skip":
                prob = xp.exp(_scores(q, kb, ctx.scale, kind, xp) - lse)
                dvb = dvb + xp.swapaxes(prob, -1, -2) @ do
                ds = prob * (do @ xp.swapaxes(vb, -1, -2) - delta)
                dq = dq + (ds @ kb) * ctx.scale
                dkb = dkb + (xp.swapaxes(ds, -1, -2) @ q) * ctx.scale
            kb, vb, dkb, dvb = _pass_on(comm, [kb, vb, dkb, dvb], xp)   # the p-th pass brings them home
        return dq, dkb, dvb, None


def ring_attention(q, k, v, comm, causal=True):
    """softmax(Q K^T / sqrt(D) [+ causal mask]) V with the sequence split across ``comm``: each rank
    passes its local (B, H, T/p, D) blocks and gets its (B, H, T/p, D) block of the output."""
    return RingAttention.apply(q, k, v, comm, causal=causal)

"""Ring attention (Li et al. 2021, "Sequence Parallelism"; Liu et al. 2023, "Ring Attention with
Blockwise Transformers"), made exact by the online softmax (Milakov & Gimelshein 2018) and balanced
under the causal mask by the zig-zag layout (Brandon et al. 2023; zigzag.py).

The sequence is split across p ranks, each holding the queries, keys and values of its chunks
(contiguous: chunk r of p; zig-zag: chunks r and 2p-1-r of 2p). No rank ever holds the (T, T) score
matrix or all the keys. Forward: the (K, V) blocks travel round the ring; at each of the p steps a
rank scores each of its query chunks against each key chunk it holds and folds the result into
that query chunk's running maximum m, running sum l and unnormalised output o:

    m' = max(m, rowmax S);   l = l·e^(m-m') + rowsum e^(S-m');   o = o·e^(m-m') + e^(S-m') V

and finally o / l: exactly softmax(S) V over the whole sequence. Causal masking, chunk by chunk:
a key chunk after the query chunk is skipped, the same chunk gets the triangular mask.

Backward: the blocks go round again with their gradient accumulators dK, dV riding along; each rank
adds its queries' contribution (recomputing the scores from the saved log-sum-exp), and the last
step sends only dK, dV, which arrive home. Bytes sent per rank and layer, with a block of
B·H·(T/p)·D numbers: forward 2(p-1) blocks (K, V), backward 4(p-1) + 2: (6p - 4) blocks in all.

Attention dropout (as FlashAttention applies it): the weights e^(S-m) meet V through the mask, while the
sum l counts them whole, so o / l is dropout(softmax(S)) V. The mask is one process's (B, H, T, T) mask:
each rank draws its queries' rows of it (B·H·T²/p numbers, parallel/dropout_masks.py; not held between
forward and backward but drawn again there from the saved generator state) and takes each key block's columns.
Backward: dV gets (P∘Z)^T dO, and dP = (dO V^T)∘Z; the row sums rowsum(dO∘O) stay right as they are.
"""
import math

from ... import random
from ...autograd import Function
from ...backend import array_module, matmul
from .zigzag import chunks_per_rank

_TAG = 7300


def _scores(q, k, scale, mask_kind, xp):
    s = matmul(q, xp.swapaxes(k, -1, -2)) * scale
    if mask_kind == "diagonal":
        t = s.shape[-1]
        s = xp.where(xp.triu(xp.ones((t, t), dtype=bool), k=1), -xp.inf, s)
    return s


def online_softmax_step(m, l, o, s, v, keep=None):
    """Fold one block of scores ``s`` (..., rows, keys) and its values ``v`` (..., keys, D) into a
    query block's running max ``m``, sum ``l`` (..., rows, 1) and unnormalised output ``o`` (Milakov &
    Gimelshein 2018): returns (m', l', o'), after which o' / l' is the softmax over every key folded so
    far, times its values. What was summed against e^-m is rescaled by e^(m - m') when the max rises.
    ``keep``, dropout's mask (0 or 1/(1-p)) on the block's weights: they meet V dropped, l counts them whole."""
    xp = array_module(s)
    m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
    correction = xp.exp(m - m_new)
    e = xp.exp(s - m_new)
    weights = e if keep is None else e * keep
    return m_new, l * correction + e.sum(axis=-1, keepdims=True), o * correction + matmul(weights, v)


def _mask_kind(q_chunk, k_chunk, causal):
    """How query chunk ``q_chunk`` sees key chunk ``k_chunk`` (chunk indices along the sequence)."""
    if not causal or k_chunk < q_chunk:
        return "none"
    return "diagonal" if k_chunk == q_chunk else "skip"


def _pass_on(comm, arrays, xp):
    """Send these arrays to rank r+1 and receive rank r-1's (a ring step)."""
    if comm.size == 1:
        return arrays
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    received = []
    for a in arrays:
        buf = xp.empty(a.shape, a.dtype)
        comm.sendrecv(xp.ascontiguousarray(a), right, buf, left, sendtag=_TAG)
        received.append(buf)
    return received


def _chunk(x, i, n):
    """The i-th of n equal pieces of x along the sequence (axis 2): a view."""
    c = x.shape[2] // n
    return x[:, :, i * c:(i + 1) * c]


def _pairs(layout, p, r, step, causal):
    """(my piece i, their piece j, mask kind, j's chunk index along the sequence) for every chunk pair rank r
    of p computes at this ring step."""
    mine, _ = chunks_per_rank(layout, p, r)
    theirs, _ = chunks_per_rank(layout, p, (r - step) % p)    # whose keys and values we hold now
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            kind = _mask_kind(qc, kc, causal)
            if kind != "skip":
                yield i, j, kind, kc


def _dropout_mask(q, dropout):
    """This rank's query rows of the attention-dropout mask, scaled: 0 or 1/(1-p). ``dropout`` = (p, draw):
    draw(q) gives their uniform numbers (b, h, T/cp, T) (parallel/dropout_masks.py: one process's)."""
    p, draw = dropout
    return ((draw(q) >= p) * (1.0 / (1.0 - p))).astype(q.dtype, copy=False)


def _columns(mask, i, n, kc):
    """The block of ``mask`` (this rank's rows) for its query piece i against key chunk kc."""
    if mask is None:
        return None
    c = mask.shape[2] // n
    return _chunk(mask, i, n)[..., kc * c:(kc + 1) * c]


class RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal=True, layout="contiguous", count=None, dropout=None):
        xp = array_module(q)
        ctx.dropout = dropout               # backward draws the same mask again, from the state it was drawn in
        ctx.rng_state = None if dropout is None else random.get_state()
        mask = None if dropout is None else _dropout_mask(q, dropout)
        p, n = comm.size, len(chunks_per_rank(layout, comm.size, comm.rank)[0])
        scale = 1.0 / math.sqrt(q.shape[-1])
        shape = _chunk(q, 0, n).shape[:-1] + (1,)
        m = [xp.full(shape, -xp.inf, dtype=q.dtype) for _ in range(n)]
        l = [xp.zeros(shape, dtype=q.dtype) for _ in range(n)]
        o = [xp.zeros_like(_chunk(q, i, n)) for i in range(n)]
        kb, vb, computed = k, v, 0
        for step in range(p):
            for i, j, kind, kc in _pairs(layout, comm.size, comm.rank, step, causal):
                s = _scores(_chunk(q, i, n), _chunk(kb, j, n), scale, kind, xp)
                fold = (m[i], l[i], o[i], s, _chunk(vb, j, n))
                m[i], l[i], o[i] = online_softmax_step(*fold) if mask is None else \
                    online_softmax_step(*fold, keep=_columns(mask, i, n, kc))
                computed += s.size
            if step < p - 1:
                kb, vb = _pass_on(comm, [kb, vb], xp)
        out = xp.concatenate([o[i] / l[i] for i in range(n)], axis=2)
        lse = xp.concatenate([m[i] + xp.log(l[i]) for i in range(n)], axis=2)
        if count is not None:
            count(computed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.scale, ctx.layout, ctx.n = comm, causal, scale, layout, n
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        xp = array_module(q)
        comm, p, n, scale = ctx.comm, ctx.comm.size, ctx.n, ctx.scale
        delta = (do * o).sum(axis=-1, keepdims=True)
        mask = None
        if ctx.dropout is not None:
            now = random.get_state()
            random.set_state(ctx.rng_state)
            mask = _dropout_mask(q, ctx.dropout)
            random.set_state(now)
        dq = xp.zeros_like(q)
        kb, vb, dkb, dvb = k, v, xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
        for step in range(p):
            for i, j, kind, kc in _pairs(ctx.layout, comm.size, comm.rank, step, ctx.causal):
                qi, doi, kj, vj = _chunk(q, i, n), _chunk(do, i, n), _chunk(kb, j, n), _chunk(vb, j, n)
                prob = xp.exp(_scores(qi, kj, scale, kind, xp) - _chunk(lse, i, n))
                keep = _columns(mask, i, n, kc)
                _chunk(dvb, j, n)[...] += matmul(xp.swapaxes(prob if keep is None else prob * keep, -1, -2), doi)
                dprob = matmul(doi, xp.swapaxes(vj, -1, -2))
                ds = prob * ((dprob if keep is None else dprob * keep) - _chunk(delta, i, n))
                _chunk(dq, i, n)[...] += matmul(ds, kj) * scale
                _chunk(dkb, j, n)[...] += matmul(xp.swapaxes(ds, -1, -2), qi) * scale
            if step < p - 1:
                kb, vb, dkb, dvb = _pass_on(comm, [kb, vb, dkb, dvb], xp)
            else:                                   # the last pass brings only the gradients home
                dkb, dvb = _pass_on(comm, [dkb, dvb], xp)
        return dq, dkb, dvb, None


def ring_attention(q, k, v, comm, causal=True, layout="contiguous", count=None, dropout=None):
    """softmax(Q K^T / sqrt(D) [+ causal mask]) V with the sequence split across ``comm`` by
    ``layout`` ("contiguous" or "zigzag", zigzag.py): each rank passes its local (B, H, T/p, D)
    blocks and gets its (B, H, T/p, D) block of the output. ``count``, if given, is called once per
    forward with the number of score entries this rank computed (the chunk blocks it did not skip).
    ``dropout`` = (p, draw): the probabilities dropped out with probability p, draw(q) giving the uniform
    numbers of the mask's rows for q's queries against all T keys (None: no dropout)."""
    return RingAttention.apply(q, k, v, comm, causal=causal, layout=layout, count=count, dropout=dropout)

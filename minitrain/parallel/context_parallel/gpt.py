"""Context parallelism on the (tensor-parallel) GPT: every rank holds T/cp positions of each row;
each block's attention core -- softmax(Q K^T) V on (B, heads, positions, D) -- is replaced by ring
attention (zig-zag layout, ring.py) or by Ulysses (contiguous layout, ulysses.py) over the cp
communicator. Everything else in a block (LayerNorms, the linears, the MLP) acts position by position
and needs no communication; the position embedding looks up the true positions (positions_of).

Megatron-Core's context parallelism does the same (its TEDotProductAttention with cp_group); its
loss is the mean over the rank's tokens, averaged over the dp x cp ranks with the gradients. Dropout
keeps one process's masks (parallel/dropout_masks.py): each rank draws its piece of every site's whole mask.
"""
from ..dropout_masks import place_dropouts
from .ring import ring_attention
from .ulysses import check_heads, ulysses_attention
from .zigzag import check_seq_len, positions_of

#: method -> the layout of the sequence over the cp ranks
METHODS = {"ring": "zigzag", "ulysses": "contiguous", "ring_contiguous": "contiguous"}


class ContextParallelCore:
    """The attention core over the cp ranks, in place of the block's own; ``computed`` counts the score
    entries this rank computed (the blocks a ring did not skip; the whole T x T of each head for Ulysses)."""

    def __init__(self, attention, comm, method, dropout=None):
        self.attention, self.comm, self.method, self.computed = attention, comm, method, 0
        self._local_core = attention.core                # the GPT's own core: Ulysses runs it on whole heads
        self.dropout = dropout                           # ring: (p, draw) of the attention dropout

    def _count(self, n):
        self.computed += n

    def _ulysses_core(self, q, k, v):
        T = q.shape[2]
        self._count(q.shape[0] * q.shape[1] * T * T)
        return self._local_core(q, k, v)

    def __call__(self, q, k, v):
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.comm, self._ulysses_core)
        dropout = self.dropout if self.attention.training else None
        return ring_attention(q, k, v, self.comm, causal=True, layout=METHODS[self.method], count=self._count,
                              dropout=dropout)


def context_parallelize(model, comm, method="ring", masks=None):
    """Put the cp attention into every block of ``model`` (a TensorParallelGPT, or an nn.GPT), its dropouts
    drawing one process's masks (``masks``: GPT3D's MaskStream, parallel/dropout_masks.py); returns the cores
    (their ``computed`` counters). A clear error for what does not split."""
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}: expected one of {tuple(METHODS)[:2]}")
    # (recomputation replays the core's forward, its ring or all-to-alls too, and its dropout draws)
    for block in model.h:
        if method == "ulysses":
            check_heads(block.attn.n_head, comm)
    ring_dropouts = place_dropouts(model, masks, comm, method, METHODS[method])
    cores = []
    for block, dropout in zip(model.h, ring_dropouts):
        core = ContextParallelCore(block.attn, comm, method, dropout)
        block.attn.core = core
        cores.append(core)
    return cores


def sequence_positions(seq_len, comm, method="ring"):
    """The positions this cp rank holds of a sequence of ``seq_len`` (one clear error if it does not split)."""
    check_seq_len(seq_len, comm.size, METHODS[method])
    return positions_of(seq_len, comm.size, comm.rank, METHODS[method])


def cp_bytes_formula(method, cp, seq_len, width, itemsize, recompute="none"):
    """Bytes one cp rank sends per row of the batch and per block, forward and backward, with ``width``
    = its heads x head size (n_embd / tp). Ring: (6cp - 4) blocks of (T/cp)·width (K, V forward cp-1 times;
    K, V, dK, dV backward cp-1 times; dK, dV home once). Ulysses: 4 all-to-alls forward (q, k, v, output)
    and 4 backward, each (cp-1)/cp of (T/cp)·width. Recomputation (full: the block, selective: the attention
    core) sends the forward's again in backward: 2(cp-1) more blocks, or 4 more all-to-alls."""
    block = seq_len // cp * width * itemsize
    if cp == 1:
        return 0
    again = recompute not in (None, "none")
    if method.startswith("ring"):
        return (6 * cp - 4 + (2 * (cp - 1) if again else 0)) * block
    return (12 if again else 8) * (cp - 1) * block // cp

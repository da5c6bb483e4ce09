"""Dropout under context parallelism, with one process's masks: every site's mask is a function of the
global place it applies to (row, position, head, feature), never of the rank that holds it.

One process draws each site's mask for the whole tensor, in the order the sites run. A cp rank runs the
same sites in the same order, draws the piece of each whole mask that it holds (random.rand_at: only
those numbers), and leaves its generator where the whole draw leaves one process's, so every rank's
generator stays in step with the others' and with one process's:

- the residual stream's dropouts (the embedding's, the attention's and the MLP's outputs), (B, T, C):
  this rank's positions (zig-zag or contiguous, cut again by tp with sequence parallelism);
- attention dropout, (B, H, T, T): under Ulysses each rank attends with whole heads, so it keeps its
  heads' masks; ring attention never holds the probabilities, so it drops the weights block by block
  with its queries' rows of the mask (ring.py);
- an MoE layer's experts: their rows among the group's (tensor_parallel/moe.py, ExpertRowsDropout).
"""
from ...autograd import ops
from ...backend import array_module
from ...nn import functional as F
from ...nn.module import Module
from .zigzag import positions_of


class PlacedDropout(Module):
    """nn.Dropout of a piece of a larger tensor: ``place(shape)`` gives (the whole tensor's shape, the piece's
    index: one slice or integer array per leading axis); the piece keeps its part of the whole's mask."""

    def __init__(self, p, place):
        super().__init__()
        self.p, self.place = p, place

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return F.dropout(x, self.p, self.training)
        full_shape, index = self.place(tuple(x.shape))
        xp = array_module(x.data)
        index = tuple(entry if isinstance(entry, slice) else xp.asarray(entry) for entry in index)
        return ops.Dropout.apply(x, self.p, full_shape=full_shape, index=index)


def sequence_place(cp_comm, layout, tp_comm=None):
    """Where a rank's (B, T/cp, C) of the residual stream sits in the whole (B, T, C): its positions; with
    sequence parallelism (``tp_comm``) its contiguous T/(cp·t) of them, tp rank r the r-th."""
    t, r = (1, 0) if tp_comm is None else (tp_comm.size, tp_comm.rank)

    def place(shape):
        B, n, C = shape
        held = positions_of(n * t * cp_comm.size, cp_comm.size, cp_comm.rank, layout)
        return (B, len(held) * cp_comm.size, C), (slice(None), held[r * n:(r + 1) * n])
    return place


def heads_place(n_head, first):
    """Where Ulysses' (B, h, T, T) attention probabilities sit in one process's (B, n_head, T, T): heads
    [first, first + h)."""
    def place(shape):
        B, h, T, _ = shape
        return (B, n_head, T, T), (slice(None), slice(first, first + h))
    return place


def place_dropouts(model, cp_comm, method, layout):
    """Every dropout of ``model`` (a TensorParallelGPT, or an nn.GPT) as a PlacedDropout of one process's masks;
    returns, per block, the attention dropout's (p, heads, first head) for ring attention (None under Ulysses,
    whose core runs the block's own dropout on its heads)."""
    p = model.config.dropout
    if not p:
        return [None] * len(model.h)
    tp = getattr(model, "comm", None)
    sequence = sequence_place(cp_comm, layout, tp if getattr(model, "sequence_parallel", False) else None)
    model.drop = PlacedDropout(p, sequence)
    ring = []
    for block in model.h:
        attn = block.attn
        attn.resid_dropout = PlacedDropout(p, sequence)
        if hasattr(block.mlp, "c_fc"):          # the MLP (an MoE layer's experts draw by rows: ExpertRowsDropout)
            block.mlp.dropout = PlacedDropout(p, sequence)
        first = (0 if tp is None else tp.rank) * attn.n_head        # this rank's heads among the model's
        if method == "ulysses":
            h = attn.n_head // cp_comm.size
            attn.attn_dropout = PlacedDropout(p, heads_place(model.config.n_head, first + cp_comm.rank * h))
            ring.append(None)
        else:
            ring.append((p, model.config.n_head, first))
    return ring

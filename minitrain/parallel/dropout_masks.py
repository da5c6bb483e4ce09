"""One process's dropout masks under any layout: every site's mask is a function of the global place it
applies to (batch row, position, head, feature), never of the rank that holds it or of when its schedule runs it.

In a training step one process draws each dropout site's whole mask, in forward order: the embedding's
(B, T, C), then per block the attention probabilities' (B, H, T, T), the attention output's and the MLP's
(B, T, C). A rank holds a piece of each: its replica's and micro-batch's rows (dp, pp's micro-batches), its
positions (cp: zig-zag or contiguous, cut again by tp under sequence parallelism), its heads (tp; Ulysses'
heads). It draws only that piece (random.rand_at), from where one process's draw of that site begins:
MaskStream knows it, the step's starting generator state plus the sizes of the sites before (on the GPU one
host seed per site), and at the end of the step puts every rank's generator where one process's stands. So
a pipeline may run the sites in any order, and full recomputation redraws the same masks.

Ring attention never holds the probabilities: it drops its weights block by block with its queries' rows of
the attention mask (context_parallel/ring.py), drawn here. Without a MaskStream (a model with MoE layers,
whose experts draw masks of as many rows as the routing gives them) each site draws its piece from where the
generator stands, which is one process's within a replica, a micro-batch and a pipeline stage (cp, tp), and
each replica, micro-batch and stage draws its own (a stage's generator starts the step where the first stage's
does: how far the stages before it moved it depends on their routing). Cost: one process's random numbers
divided among the ranks that hold them.
"""
import contextlib

from .. import random
from ..autograd import ops
from ..backend import array_module, is_device_array
from ..nn import functional as F
from ..nn.module import Module
from .context_parallel.zigzag import positions_of


class MaskStream:
    """Where each site's mask begins in one process's random stream this step, and the rows being computed.
    An inactive one (no dropout; MoE layers) leaves every draw where the generator stands."""

    def __init__(self, config, device=False, active=True):
        self.config, self.device, self.active, self.start = config, device, active, None
        self.replica_start = self.microbatch_start = 0
        self.rows = None                              # the global batch's rows, this step

    @classmethod
    def of(cls, gpt, moe=False):
        """The stream of ``gpt`` (an nn.GPT) under GPT3D: active with dropout and without MoE layers."""
        return cls(gpt.config, is_device_array(gpt.wte.weight.data), active=bool(gpt.config.dropout) and not moe)

    def begin_microbatch(self, first):
        """The pipeline computes the micro-batch whose rows of the replica's batch begin at ``first``."""
        self.microbatch_start = first

    def sizes(self, B, T):
        """The sites in one process's order, each with the numbers its whole mask draws (one seed on the GPU)."""
        C, H = self.config.n_embd, self.config.n_head
        sites = [("embedding", 0, B * T * C)]
        for layer in range(self.config.n_layer):
            sites += [("attention", layer, B * H * T * T), ("attention output", layer, B * T * C),
                      ("mlp", layer, B * T * C)]
        return [(kind, layer, 1 if self.device else n) for kind, layer, n in sites]

    def begin_step(self, rows, seq_len):
        if not self.active:
            return
        self.start, self.rows, offset, self.offsets = random.get_state(), rows, 0, {}
        for kind, layer, n in self.sizes(rows, seq_len):
            self.offsets[kind, layer] = offset
            offset += n
        self.total = offset

    def end_step(self):
        """Every rank's generator where one process's stands after the step's draws."""
        if self.start is None:
            return
        random.jump(self.start, self.total)
        self.start = None

    def batch_rows(self, b):
        """(the whole batch's rows, the index of this micro-batch's ``b``) while a step runs, else (b, all)."""
        if self.start is None:
            return b, slice(None)
        first = self.replica_start + self.microbatch_start
        return self.rows, slice(first, first + b)

    @contextlib.contextmanager
    def at(self, site):
        """Draw inside the block from where one process's draw of ``site`` begins (outside a step: as it stands)."""
        if self.start is not None:
            random.jump(self.start, self.offsets[site])
        yield


class PlacedDropout(Module):
    """nn.Dropout of a piece of a larger tensor: ``place(shape)`` gives the whole tensor's shape past the batch
    axis and the piece's index there (a slice or an integer array per axis); the batch rows and where the draw
    begins come from ``stream`` (or, without one, the rows are all the whole's and the draw begins here)."""

    def __init__(self, p, place, stream=None, site=None):
        super().__init__()
        self.p, self.place, self.stream, self.site = p, place, stream, site

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return F.dropout(x, self.p, self.training)
        whole, index = self.place(tuple(x.shape[1:]))
        rows, mine = (x.shape[0], slice(None)) if self.stream is None else self.stream.batch_rows(x.shape[0])
        xp = array_module(x.data)
        index = tuple(entry if isinstance(entry, slice) else xp.asarray(entry) for entry in (mine,) + index)
        with self.stream.at(self.site) if self.stream is not None else contextlib.nullcontext():
            return ops.Dropout.apply(x, self.p, full_shape=(rows,) + whole, index=index)


def sequence_place(cp_comm=None, layout=None, tp_comm=None):
    """Where a rank's (T/cp, C) of the residual stream sits in the whole (T, C): its positions; with sequence
    parallelism (``tp_comm``) its contiguous T/(cp·t) of them, tp rank r the r-th."""
    cp, c = (1, 0) if cp_comm is None else (cp_comm.size, cp_comm.rank)
    t, r = (1, 0) if tp_comm is None else (tp_comm.size, tp_comm.rank)

    def place(shape):
        n, C = shape
        held = positions_of(n * t * cp, cp, c, layout or "contiguous")
        return (len(held) * cp, C), (held[r * n:(r + 1) * n],)
    return place


def heads_place(n_head, first):
    """Where (h, T, T) attention probabilities sit in one process's (n_head, T, T): heads [first, first + h)."""
    def place(shape):
        h, T, _ = shape
        return (n_head, T, T), (slice(first, first + h),)
    return place


def ring_mask_rows(p, n_head, first, cp_comm, layout, stream, layer):
    """Ring attention's draw: for its q (b, h, T/cp, D), the uniform numbers of its queries' rows of one
    process's (B, n_head, T, T) attention mask (ring.py turns them into the mask, forward and backward)."""
    def draw(q):
        b, h, t, _ = q.shape
        T = t * cp_comm.size
        rows, mine = (b, slice(None)) if stream is None else stream.batch_rows(b)
        index = (mine, slice(first, first + h), positions_of(T, cp_comm.size, cp_comm.rank, layout))
        with stream.at(("attention", layer)) if stream is not None else contextlib.nullcontext():
            if is_device_array(q):             # on the GPU drawn whole there, as autograd's Dropout draws it
                whole = random.device_uniform(rows, n_head, T, T, dtype=q.dtype)
                return whole[index[:2] + (array_module(q).asarray(index[2]),)]
            return random.rand_at((rows, n_head, T, T), index, q.dtype)
    return p, draw


def place_dropouts(model, stream=None, cp_comm=None, method="ring", layout=None):
    """Every dropout of ``model`` (a TensorParallelGPT, or an nn.GPT) as a PlacedDropout of one process's masks,
    under context parallelism over ``cp_comm`` by ``method`` if given; returns, per block, ring attention's
    (p, draw) (None where the block's own core applies its attention dropout: no cp, or Ulysses)."""
    p = model.config.dropout
    if not p:
        return [None] * len(model.h)
    tp = getattr(model, "comm", None)
    sequence = sequence_place(cp_comm, layout, tp if getattr(model, "sequence_parallel", False) else None)
    model.drop = PlacedDropout(p, sequence, stream, ("embedding", 0))
    ring = []
    for layer, block in enumerate(model.h):
        attn = block.attn
        attn.resid_dropout = PlacedDropout(p, sequence, stream, ("attention output", layer))
        if hasattr(block.mlp, "c_fc"):          # the MLP (an MoE layer's experts draw by rows: ExpertRowsDropout)
            block.mlp.dropout = PlacedDropout(p, sequence, stream, ("mlp", layer))
        first = (0 if tp is None else tp.rank) * attn.n_head        # this rank's heads among the model's
        if cp_comm is not None and method != "ulysses":
            ring.append(ring_mask_rows(p, model.config.n_head, first, cp_comm, layout, stream, layer))
            continue
        if cp_comm is not None:                 # Ulysses: the rank attends with H/(t·cp) whole heads
            first += cp_comm.rank * attn.n_head // cp_comm.size
        attn.attn_dropout = PlacedDropout(p, heads_place(model.config.n_head, first), stream, ("attention", layer))
        ring.append(None)
    return ring

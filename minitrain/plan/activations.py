"""What each layer keeps for backward, in bytes: the activation side of minitrain's accounting.

A Piece is one layer of the Sequential a pipeline cuts (the MLP's Linear / ReLU modules, or the GPT's
[embedding, blocks, head] as GPT3D lays them out), with its parameters. Counted as the ledger counts: each
array once, by the buffer that owns it (a Linear after a ReLU saves the ReLU's own output; micro-batches that
are views of one batch count that batch once). A transformer block saves sbh(4 + 16/t) + as²b/t + 2sb
values, with SP 20sbh/t + as²b/t + 2sb/t (derived in parallel/tensor_parallel/gpt.py); selective recomputation
drops the as²b/t of the attention core, full recomputation keeps the block's input only (sbh, sbh/t with
SP) and holds the whole block again in its backward. In a zero-bubble schedule a block's B frees what only the
input gradients need (the attention core, q, k, v, GELU's input, dropout's masks) and leaves for W the inputs its
nodes with weights saved: 9sbh + 2sb values at t = 1, with or without recomputation (gpt_block_w_nodes).
"""
from functools import lru_cache

from ..parallel.recompute import default_segments
from .layout import PRECISIONS, Layout

INT64 = 8


class Piece:
    """One layer of the Sequential a pipeline cuts: its parameters as ``units`` (FSDP's units, each a list
    of tensors' element counts, tp shards), what it keeps for backward per micro-batch (``kept``), its own
    bytes at the worst moment of its backward (``peak``: more than kept when it is recomputed), and
    ``shared``: bytes held once per step whatever the micro-batch count (an array that every
    micro-batch's slice is a view of); ``moments``: see __init__. ``deferred``: what it holds from its B to its W
    in a zero-bubble schedule (the saved inputs of the nodes with a weight, which W computes on: autograd/deferred.py;
    the others are freed by B), kept unless given (or the sum of ``w_nodes``); ``w_nodes``: those nodes in W's
    order (B's), each as (bytes it frees, parameters it makes gradients for): one unless given."""

    def __init__(self, name, units, kept, peak=None, shared=0, moments=None, deferred=None, w_nodes=None):
        self.name, self.units, self.kept, self.shared = name, [list(u) for u in units if u], kept, shared
        self.peak = kept if peak is None else peak
        self.deferred = (sum(freed for freed, _ in w_nodes) if w_nodes else
                         kept if deferred is None else deferred)
        self._moments = moments
        self.sizes = [q for u in self.units for q in u]
        self.params = sum(self.sizes)
        self._w_nodes = w_nodes
        self.unhooked = False      # recomputed in backward, outside FSDP's hooks: its saved weights are views of
        #                            its units, gathered by the recomputation and kept until their reduce-scatter
        self.parts = [self]        # a recomputed segment: the layers its backward goes through
        self.input_freed_first = 0  # bytes of kept that its first part's backward frees (before its gradients)

    @property
    def w_nodes(self):
        return self._w_nodes or [(self.deferred, self.params)]

    @property
    def moments(self):
        """The moments of its backward: (its bytes, its parameters whose gradients are made by then); one, at
        its peak, unless given (a block recomputing its attention core midway, after its MLP's gradients)."""
        return [(self.peak, 0)] if self._moments is None else self._moments


def fp32(layout):
    """Bytes of what mixed precision keeps in fp32 (LayerNorm's 1/σ, the loss's log-probabilities): 4, else the
    layout's own itemsize."""
    return 4 if layout.mixed else PRECISIONS[layout.precision]


def mlp_pieces(model, layout, rows, in_pipeline=False):
    """The MLP's modules (Linear saves its input, ReLU its output), or with ``--recompute full``
    checkpoint_sequential's round(sqrt(n)) segments (each keeps only its input)."""
    e = PRECISIONS[layout.precision]
    loss_e = 4 if layout.mixed else e               # logits go back to fp32 for the loss
    modules = model.modules()
    width = [modules[0][1]] + [m[2] for m in modules]       # width of the tensor entering module j
    pieces = []
    for j, (kind, i, o) in enumerate(modules):
        if kind == "linear":
            first = j == 0 or modules[j - 1][0] != "relu"   # after a ReLU its input is the ReLU's output
            kept = rows * i * e if first else 0
            shared = 0
            if j == 0 and in_pipeline:                      # micro-batches are views of the local batch
                kept, shared = 0, layout.replica_rows * i * e    # the heaviest replica
            pieces.append(Piece(f"linear{j // 2}", [[i * o, o]], kept, shared=shared))
        else:
            pieces.append(Piece(f"relu{j // 2}", [], rows * o * e))
    loss = rows * model.sizes[-1] * loss_e + (0 if in_pipeline else rows * INT64)
    pieces[-1].kept += loss + (e if in_pipeline else 0)     # log-softmax (+ targets; pipeline: loss / m)
    pieces[-1].peak = pieces[-1].kept
    pieces[-1].deferred = pieces[-1].kept - loss - (e if in_pipeline else 0)   # the loss's own: freed by B
    if in_pipeline:
        pieces[-1].shared += layout.replica_rows * INT64      # targets: views of the local batch
    if layout.recompute != "full" or in_pipeline:
        if layout.offload_activations:
            for p in pieces:
                p.kept = p.peak = p.shared = p.deferred = 0
        return pieces
    n = len(modules)
    k = default_segments(n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    segments = []
    for i in range(k):
        lo, hi = bounds[i], bounds[i + 1]
        part = pieces[lo:hi]
        units = [u for p in part for u in p.units]
        entering = rows * width[lo] * e
        inner = sum(p.kept for p in part) - (entering if lo == 0 else 0)   # without the segment's input
        if i == k - 1:         # the last segment runs plain (as in PyTorch): a Linear first saves its input
            first = entering if modules[lo][0] == "linear" else 0
            segments.append(Piece(f"segment{i}", units, 0 if layout.offload_activations else inner + first))
            # that input is the checkpointed segment's output, saved by this Linear alone: its backward frees it
            segments[-1].input_freed_first = 0 if layout.offload_activations else first
            continue
        # checkpointed: keeps its input; backward recomputes it outside any offload context
        if layout.offload_activations:       # only the recomputed Linear's re-saved input is on the device
            peak = inner + (entering if modules[lo][0] == "linear" else 0)
            segments.append(Piece(f"segment{i}", units, 0, peak=peak))
        else:
            segments.append(Piece(f"segment{i}", units, entering, peak=entering + inner))
    if layout.offload_activations:         # the last segment's layers save to the host: none of it to free here
        for p in pieces[bounds[k - 1]:]:
            p.kept = p.peak = 0
    for i, segment in enumerate(segments):
        segment.parts = pieces[bounds[i]:bounds[i + 1]]
        segment.unhooked = i < k - 1       # (the last runs plain, inside FSDP's call: re-gathered unit by unit)
    return segments


def gpt_block_bytes(model, layout, b, moe=False):
    """(kept, peak, at_core) bytes of one transformer block for a micro-batch of b rows (see module docstring);
    s/cp tokens of each row under context parallelism (plan/context.py), an MoE layer's MLP with ``moe``
    (plan/experts.py).
    at_core: with selective recomputation, the bytes while the attention core is recomputed, midway through the
    block's backward, when the gradients of its MLP, ln_2 and c_proj are made (else None)."""
    from .context import attention_core_values
    from .experts import dense_mlp_values, moe_kept_values
    e = PRECISIONS[layout.precision]
    s, h, t = model.block_size // layout.cp, model.n_embd, layout.tp
    r = t if layout.sequence_parallel else 1           # replicated regions shrink by t under SP
    core = attention_core_values(model, layout, b)      # softmax output (+ dropout's mask and output)
    ln = s * b * h / r + s * b / r * fp32(layout) / e   # x̂ and 1/σ (mixed precision: 1/σ in fp32)
    attn_in = ln + s * b * h / r + 3 * s * b * h / t    # ln_1, c_attn's input, the qkv buffer
    mlp = moe_kept_values(model, layout, b) if moe else dense_mlp_values(model, layout, b)
    full = (2 * ln + s * b * h / r + 4 * s * b * h / t + mlp + core
            + (2 * s * b * h / r if model.dropout else 0))
    # (ring attention's K, V, dK and dV in transit in its backward are transients inside one op, which the
    # ledger does not track, as it does not track a matmul's: it measured a --cp 2 step equal without them)
    if layout.offload_activations:
        # what forward saves goes to the host; what backward recomputes runs outside the offload context, so it
        # is on the device through the block's backward: the whole block (full), the attention core and the
        # q, k, v it saves, views of the qkv buffer (selective)
        if layout.recompute == "selective":
            recomputed = e * (3 * s * b * h / t + core)
            return 0, recomputed, recomputed
        return 0, e * full if layout.recompute == "full" else 0, None
    if layout.recompute == "full":
        kept = s * b * h / r
        return e * kept, e * (kept + full), None
    if layout.recompute == "selective":
        return e * (full - core), e * max(full - core, attn_in + core), e * (attn_in + core)
    return e * full, e * full, None


def gpt_block_w_nodes(model, layout, b, mlp_params, moe=False):
    """A transformer block's nodes with weights in W's order (its B's: the MLP's c_proj and c_fc, ln_2, c_proj,
    c_attn, ln_1; an MoE layer's experts, shared experts and router as one), each as (the bytes of the inputs it
    saved, held from the block's B to its W in a zero-bubble schedule, its parameters): x̂ and 1/σ, or a Linear's
    input. Whatever the recomputation (a recomputed block's B saves them again; on the device under an offload,
    as the recomputation runs without the offload's hooks); nothing held for a block not recomputed under an
    offload (its saves are on the host)."""
    from .experts import received_rows
    e = 0 if layout.offload_activations and layout.recompute != "full" else PRECISIONS[layout.precision]
    s, h, t = model.block_size // layout.cp, model.n_embd, layout.tp
    r = t if layout.sequence_parallel else 1
    N = s * b
    f32 = fp32(layout) if e else 0                      # 1/σ (nothing held under the offload, as x̂)
    ln = (e * N * h / r + f32 * N / r, 2 * h)
    if moe:
        M, f = received_rows(model, layout, b), model.expert_ffn
        mlp = [(e * (N * h / r + M * h + M * f + model.moe_shared * (N * h + N * f) / r), sum(mlp_params))]
    else:
        f = model.ffn
        mlp = [(e * N * f / t, f * h // t + h), (e * N * h / r, h * f // t + f // t)]
    return mlp + [ln, (e * N * h / t, h * h // t + h), (e * N * h / r, 3 * h * h // t + 3 * h // t), ln]


def gpt_pieces(model, layout, rows, single_process=False):
    """[embedding, block 0..L-1, head] as GPT3D lays the tensor-parallel GPT out for the pipeline."""
    return list(_gpt_pieces(model, rows, single_process, layout.tp, layout.sequence_parallel, layout.recompute,
                            layout.precision, layout.batch_size, layout.offload_activations, layout.cp,
                            layout.cp_method, layout.ep, layout.dp, layout.moe_load))


@lru_cache(maxsize=256)
def _gpt_pieces(model, rows, single_process, *key):
    from .experts import moe_backward_moments, moe_mlp_sizes
    layout = Layout(**dict(zip(("tp", "sequence_parallel", "recompute", "precision", "batch_size",
                                "offload_activations", "cp", "cp_method", "ep", "dp", "moe_load"), key)))
    e = PRECISIONS[layout.precision]
    s, h, t, V = model.block_size // layout.cp, model.n_embd, layout.tp, model.vocab_size
    r = t if layout.sequence_parallel else 1
    v_pad = -(-V // t) * t
    emb_kept = rows * s * INT64 + s / r * INT64 + (e * rows * s * h / r if model.dropout else 0)
    f32 = fp32(layout)                                  # 1/σ, the log-probabilities and the loss (fp32 if mixed)
    head_kept = e * 2 * rows * s * h / r + f32 * (rows * s / r + rows * s * v_pad / t) + (0 if single_process else f32)
    targets = layout.batch_size * s * INT64             # y: the global batch's array (a replica's rows: a view)
    if single_process:                                  # nn.GPT saves idx itself (the batch's own array)
        emb_kept = s * INT64 + (e * rows * s * h if model.dropout else 0)
        emb_shared = layout.batch_size * s * INT64
    else:
        emb_shared = 0
    f = model.ffn
    attention = [h, h, 3 * h * h // t, 3 * h // t, h * h // t, h, h, h]
    block = attention + [h * f // t, f // t, f * h // t, h]
    if layout.offload_activations:
        emb_kept = emb_shared = head_kept = targets = 0

    def block_piece(name, mlp, moe):
        kept, peak, at_core = gpt_block_bytes(model, layout, rows, moe)
        made = sum(attention[4:]) + sum(mlp)        # c_proj, ln_2 and the MLP: their gradients come first
        moments = None if at_core is None else [(kept, 0), (at_core, made)]
        if moe and not layout.offload_activations:   # the MLP's backward comes first: its experts one by one
            start = peak if layout.recompute == "full" else kept
            inside = [(start - e * freed, made) for freed, made in moe_backward_moments(model, layout, rows)]
            moments = [(start, 0)] + inside + (moments or [])[1:]
        w_nodes = gpt_block_w_nodes(model, layout, rows, mlp, moe)
        return Piece(name, [attention + mlp], kept, peak, moments=moments, w_nodes=w_nodes)

    one_block = block_piece("block", block[len(attention):], False)    # every block alike: L times
    moe_block = block_piece("moe_block", moe_mlp_sizes(model, layout), True) if model.moe_experts else None
    blocks = [moe_block if model.is_moe_layer(i) else one_block for i in range(model.n_layer)]
    # B frees the embedding's dropout and the head's logits (the loss's); W's nodes: the position lookup, then the
    # token lookup (their indices), and the head's Linear (its input), then ln_f (x̂ and 1/σ)
    held = 0 if layout.offload_activations else 1
    emb_nodes = [(held * s / r * INT64, model.block_size * h), (held * rows * s * INT64, v_pad * h // t)]
    head_nodes = [(held * e * rows * s * h / r, v_pad * h // t),
                  (held * (e * rows * s * h / r + f32 * rows * s / r), 2 * h)]
    return tuple([Piece("embedding", [[v_pad * h // t, model.block_size * h]], emb_kept, shared=emb_shared,
                        w_nodes=emb_nodes)]
                 + blocks + [Piece("head", [[h, h, v_pad * h // t]], head_kept, shared=targets,
                                   w_nodes=head_nodes)])

"""What a step does on one rank, counted: the matmuls, the ops (plan/ops.py), the graph nodes and the
parameters whose gradient is set, layer by layer, as the library's code runs them (time.py turns it into
seconds). The counts follow the code line by line; the jobs report the nodes they record per step and
plan validate compares them with recorded_nodes here.

A transformer block on b rows of s tokens, width h, a heads, t tensor-parallel ranks: E = b·s·h values,
E/t in the tensor-parallel regions, E/r in the replicated ones (r = t with sequence parallelism, else 1),
S = b·(a/t)·s² attention scores. On the CPU a Linear of a (b, s, h) input is NumPy's batched matmul (b
products of s rows); on the GPU one product of b·s rows (ops.matmul_rows).
"""
from dataclasses import replace


class Work:
    """Matmuls (m, k, n, batch: ``batch`` products of m x k @ k x n in one call), ops {(name, dtype): [elements,
    calls]}, elementwise passes of other work {(kind, dtype): elements} and their NumPy ``calls``, graph ``nodes``
    recorded, ``unrecorded`` (ops run without recording a node: under no_grad, a recomputed segment's first
    forward; their Python, the modules' and the ops' calls, is a node's), ``leaves`` (parameters given their first
    gradient of the step), new memory touched (``fresh`` bytes), and the Python of DDP's hooks per parameter,
    FSDP's per unit, traced spans, pipeline actions and ring attention's chunk pairs. A backward's ``w``: the
    part of it that computes the weights' gradients (W of a zero-bubble schedule; the rest is B), counted in
    it too."""

    def __init__(self):
        self.mm, self.ops, self.ew, self.nodes, self.calls, self.fresh = [], {}, {}, 0, 0, 0.0
        self.leaves = self.hooks = self.units = self.spans = self.actions = self.unrecorded = self.ring_pairs = 0
        self.w = None

    def weight_grads(self, work=None):
        """The W part (created empty); with ``work``: that Work added here and to the W part."""
        if self.w is None:
            self.w = Work()
        if work is not None:
            self.add(work)
            self.w.add(work)
        return self.w

    def matmul(self, m, k, n, batch=1, times=1):
        self.mm += [(m, k, n, batch)] * times
        return self

    def op(self, name, elements, count=1, dtype=None, calls=None):
        """``count`` calls of op ``name`` on ``elements`` each (``calls``: when the elements are not per call)."""
        entry = self.ops.setdefault((name, dtype), [0, 0])
        entry[0] += elements * count
        entry[1] += count if calls is None else calls
        return self

    def elementwise(self, kind, elements, count=1, dtype=None, calls=True):
        self.ew[kind, dtype] = self.ew.get((kind, dtype), 0) + elements * count
        self.calls += count if calls else 0
        return self

    def add(self, other, times=1):
        self.mm += other.mm * times
        for key, (n, c) in other.ops.items():
            entry = self.ops.setdefault(key, [0, 0])
            entry[0] += n * times
            entry[1] += c * times
        for key, n in other.ew.items():
            self.ew[key] = self.ew.get(key, 0) + n * times
        for name in ("nodes", "calls", "fresh", "leaves", "hooks", "units", "spans", "actions", "unrecorded",
                     "ring_pairs"):
            setattr(self, name, getattr(self, name) + getattr(other, name) * times)
        if other.w is not None:
            self.weight_grads().add(other.w, times)
        return self


def runs_nn_gpt(layout):
    """Whether the job runs nn.GPT itself (no f, g; a full vocabulary): one process, or experts on dp ranks."""
    return (layout.tp == 1 and layout.world == 1 and not layout.extras.get("parallel_job")) or \
        bool(layout.extras.get("moe_dp_job"))


def _linear(work, rows, s, k, n, batched, bias=True):
    """A Linear's forward on rows x s tokens: one node, the matmul, the bias added in place."""
    work.matmul(s, k, n, rows) if batched else work.matmul(rows * s, k, n)
    if bias:
        work.op("bias", rows * s * n)
    work.nodes += 1
    return work


def _linear_backward(work, rows, s, k, n, batched, bias=True, input_grad=True):
    """Its backward: the input's gradient (batched as the forward); W: the weight's (rows folded), the bias's."""
    if input_grad:
        work.matmul(s, n, k, rows) if batched else work.matmul(rows * s, n, k)
    w = Work().matmul(n, rows * s, k)
    w.leaves += 2 if bias else 1
    if bias:
        w.op("sum_leading", rows * s * n)
    work.weight_grads(w)
    return work


def _layer_norm_backward(work, n):
    """A LayerNorm's backward on n values (priced whole); W's part of it: its weight's and bias's sums."""
    work.op("layer_norm.backward", n).leaves += 2
    work.weight_grads().op("sum_leading", n, count=2).leaves += 2
    return work


# ---------------------------------------------------------------- the MLP
def mlp_layer_work(model, layout, rows):
    """Per module of nn.MLP: (forward, backward) Work for ``rows`` rows; the loss (and under mixed precision
    the cast of the logits to fp32, and fp16's loss scaling) on the last."""
    out = []
    for j, (kind, i, o) in enumerate(model.modules()):
        if kind == "linear":
            fwd = _linear(Work(), rows, 1, i, o, False)
            bwd = _linear_backward(Work(), rows, 1, i, o, False, input_grad=j > 0)
        else:
            fwd, bwd = Work().op("relu", rows * o), Work().op("relu.backward", rows * o)
            fwd.nodes += 1
        out.append((fwd, bwd))
    classes, loss = model.sizes[-1], ("fp32" if layout.mixed else None)
    fwd, bwd = out[-1]
    fwd.op("cross_entropy", rows * classes, dtype=loss)
    bwd.op("cross_entropy.backward", rows * classes, dtype=loss)
    fwd.nodes += 1
    if layout.mixed:                                   # out.float(): a Cast node, and back in backward
        fwd.op("cast", rows * classes).nodes += 1
        bwd.op("cast", rows * classes, dtype=loss)
        fwd.op("cast", rows * model.sizes[0])         # the input, not recorded (it needs no gradient)
    if layout.precision == "fp16":                      # the loss scaled: one Mul node on a scalar
        fwd.nodes += 1
    if layout.pp > 1:                                   # the pipeline runtime's loss / m: a Mul node
        fwd.nodes += 1
    return out


# ---------------------------------------------------------------- the GPT
def gpt_block_work(model, layout, rows, device="cpu", moe=False):
    """One transformer block, one micro-batch: (forward, backward) Work, as nn.GPT's Block runs it in one
    process and tensor_parallel.ParallelBlock under the parallel job (f and g nodes, the row-parallel bias
    added after g; with SP the column-parallel Linears gather the sequence themselves). Under context
    parallelism its s/cp tokens; ``moe``: an MoE layer's MLP (experts_work)."""
    s, h, a, t = model.block_size // layout.cp, model.n_embd, model.n_head, layout.tp
    single = runs_nn_gpt(layout)
    sp = layout.sequence_parallel
    r = t if sp else 1
    E, Er, Et, S = rows * s * h, rows * s * h / r, rows * s * h / t, rows * (a // t) * s * s
    batched, d, at = device == "cpu", h // a, a // t
    drop = bool(model.dropout)
    ulysses = layout.cp > 1 and layout.cp_method == "ulysses"
    q, kv, heads = s, s, rows * at                    # queries x keys per product, products
    if ulysses:
        q = kv = model.block_size                     # a/cp heads over the whole sequence
        heads, S = rows * at // layout.cp, rows * at // layout.cp * q * q
    if layout.cp > 1 and not ulysses:                 # ring: one node, its online softmax pair by pair
        from .context import ring_attention_work      # (its dropout inside that node)
        core_f, core_b = ring_attention_work(rows * at, s, d, layout.cp, dropout=drop)
    else:                                             # softmax(q k^T / sqrt(d) + mask) v, and its backward
        core_f, core_b = Work(), Work()
        core_f.matmul(q, d, kv, heads).op("softmax", S).matmul(q, kv, d, heads)
        core_f.nodes += 4                             # k's transpose, two MatMuls, the Softmax
        core_b.matmul(q, kv, d, heads).matmul(d, q, kv, heads).op("softmax.backward", S)
        core_b.matmul(q, d, kv, heads).matmul(q, kv, d, heads)
        if drop:
            core_f.op("dropout", S).nodes += 1
            core_b.op("dropout.backward", S)

    fwd, bwd = Work(), Work()
    if ulysses:
        fwd.nodes += 4                                # q, k, v to heads, the output back to the sequence
    for _ in range(2):                                # ln_1, ln_2 and the residual adds around them
        fwd.op("layer_norm", Er).op("add", Er)
        _layer_norm_backward(bwd, Er).op("add", Er)              # the residual's gradient meets the branch's
        fwd.nodes += 2
    f = model.ffn
    for width in ((3 * h // t,) if moe else (3 * h // t, f // t)):     # c_attn, c_fc: column-parallel
        _linear(fwd, rows, s, h, width, batched)
        _linear_backward(bwd, rows, s, h, width, batched)
        if sp:                                        # AllGatherLinear: one node; the sequence re-laid
            fwd.op("copy", Er).op("copy", E)          # before and after its all-gather
            bwd.op("copy", Er, count=2).op("copy", E, count=2)   # gathered again, the gradient scattered
        elif not single:
            fwd.nodes += 1                            # f: identity forward (its all-reduce is comm)
    for width in ((h // t,) if moe else (h // t, f // t)):   # c_proj (attention), c_proj (MLP): row-parallel
        _linear(fwd, rows, s, width, h, batched, bias=single)
        _linear_backward(bwd, rows, s, width, h, batched, bias=single)
        if not single:                                # g, then the bias added (a broadcast Add node)
            fwd.op("add", Er).nodes += 2
            bias = Work().op("sum_leading", Er)
            bias.leaves += 1
            bwd.weight_grads(bias)
            if sp:                                    # g is a reduce-scatter: re-laid around it
                fwd.op("copy", Er).op("copy", E)
                bwd.op("copy", Er).op("copy", E)
    if moe:
        from .experts import experts_work
        ef, eb = experts_work(model, layout, rows)
        fwd.add(ef)
        bwd.add(eb)
    else:
        fwd.op("gelu", Et * f // h).nodes += 1
        bwd.op("gelu.backward", Et * f // h)
    # q, k, v: three slices of c_attn's output, reshaped by heads and transposed (9 view nodes); the
    # heads laid side by side again after the core (a transpose and a reshape that copies)
    fwd.op("copy", Et).nodes += 11
    bwd.op("copy", Et, count=3)                        # q, k, v's gradients reshaped back: copies
    bwd.op("zeros", 3 * Et, count=3).op("copy", Et, count=3)   # GetItem's backward: a zero qkv, its slice set
    bwd.op("inplace_add", 3 * Et, count=2)             # ... and the three summed
    if drop:                                           # the two residual dropouts
        fwd.op("dropout", Er, count=2).nodes += 2
        bwd.op("dropout.backward", Er, count=2)
    if layout.recompute == "selective":               # the core runs under no_grad, again in backward
        fwd.add(core_f).nodes += 1 - core_f.nodes
        fwd.unrecorded += core_f.nodes
        bwd.add(core_f).add(core_b)
    else:
        fwd.add(core_f)
        bwd.add(core_b)
    if layout.recompute == "full":                    # one checkpoint node; backward redoes the forward
        bwd.add(fwd)
        fwd.nodes, fwd.unrecorded = 1, fwd.unrecorded + fwd.nodes
    from .activations import gpt_block_bytes
    fwd.fresh = gpt_block_bytes(model, replace(layout, recompute="none"), rows, moe)[0]
    return fwd, bwd


def gpt_ends_work(model, layout, rows, device="cpu"):
    """(embedding forward, backward), (head + loss forward, backward) Work for one micro-batch: nn.GPT's in
    one process; the parallel job's vocabulary-parallel embedding (rows outside the shard masked, g) and
    loss, and the runtime's loss / m (a Mul node)."""
    s, h, t = model.block_size, model.n_embd, layout.tp
    single = runs_nn_gpt(layout)
    r = t if layout.sequence_parallel else 1
    N, v, batched = rows * s, -(-model.vocab_size // t), device == "cpu"
    E, Er = N * h, N * h / r
    emb_f = Work().op("embedding", E).op("embedding", s * h / r).op("add", Er)
    emb_b = Work().op("sum_leading", Er)              # (wpe's rows broadcast over the batch); W: both lookups'
    lookups = Work().op("embedding.backward", E).op("embedding.backward", s * h / r)
    lookups.leaves += 2
    emb_b.weight_grads(lookups)
    emb_f.nodes = 3
    if not single:                                    # rows of other shards zeroed, then g over tp
        emb_f.op("masked_fill", E).nodes += 2
        emb_b.op("masked_fill.backward", E)
        emb_f.elementwise("simple", N, 4, "int64")    # the token ids moved into the shard
    if model.dropout:
        emb_f.op("dropout", Er).nodes += 1
        emb_b.op("dropout.backward", Er)
    head_f = Work().op("layer_norm", Er)
    head_b = _layer_norm_backward(Work(), Er)
    head_f.nodes = 1
    _linear(head_f, rows, s, h, v, batched, bias=False)
    _linear_backward(head_b, rows, s, h, v, batched, bias=False)
    loss = "fp32" if layout.mixed else None
    head_f.op("cross_entropy", N * v, dtype=loss).nodes += 1 if not single else 2    # nn.GPT: (B·T, V) first
    head_b.op("cross_entropy.backward", N * v, dtype=loss)
    if not single:                                    # vocab-parallel: a copy of the logits, the padding
        head_f.op("copy", N * v, dtype=loss)          # masked; f (or SP's gather) before the head; loss / m
        head_b.op("copy", N * v, dtype=loss)
        head_f.nodes += 1 if layout.sequence_parallel else 2
        if layout.sequence_parallel:
            head_f.op("copy", Er).op("copy", E)
            head_b.op("copy", Er, count=2).op("copy", E, count=2)
    return (emb_f, emb_b), (head_f, head_b)


def optimizer_work(n_params, n_tensors, layout):
    """The optimizer's step over ``n_params`` parameters in ``n_tensors`` tensors (ops "adam" / "sgd": per
    tensor and per element, measured). Mixed precision (optim/mixed_precision.py) first checks the gradients
    for inf/NaN, casts them to fp32 (fp16: and unscales them), and after the step rounds the fp32 masters
    back into the parameters; offload without it copies the gradients to the host and the parameters back."""
    state = "fp32" if layout.mixed else None
    w = Work().op("sgd" if layout.optimizer == "sgd" else "adam", n_params, dtype=state, calls=n_tensors)
    if layout.mixed:
        w.elementwise("reduce", n_params, calls=False).calls += n_tensors
        w.op("cast", n_params, calls=n_tensors).op("cast", n_params, dtype="fp32", calls=n_tensors)
        if layout.precision == "fp16":
            w.elementwise("inplace", n_params, 1, "fp32", calls=False).calls += n_tensors
    elif layout.offload:
        w.op("copy", n_params, count=2, calls=2 * n_tensors)
    return w


def mlp_recompute(works, layout):
    """checkpoint_sequential's round(sqrt(n)) segments: each but the last is one checkpoint node forward,
    its modules' forward again (recorded) in backward."""
    from ..parallel.recompute import default_segments
    n = len(works)
    k = default_segments(n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    out = []
    for i in range(k):
        for j in range(bounds[i], bounds[i + 1]):
            fwd, bwd = works[j]
            if i < k - 1:
                bwd = Work().add(bwd).add(fwd)
                fwd = Work().add(fwd)
                fwd.nodes, fwd.unrecorded = (1 if j == bounds[i] else 0), fwd.unrecorded + fwd.nodes
            out.append((fwd, bwd))
    return out


def recorded_nodes(works, microbatches):
    """Graph nodes a rank records per step: forward's, and those recomputation records again in backward,
    per micro-batch (``works``: the rank's layers' (forward, backward) Work)."""
    return microbatches * sum(f.nodes + b.nodes for f, b in works)

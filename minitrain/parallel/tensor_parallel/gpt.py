"""The GPT, tensor-parallel (Shoeybi et al. 2019, sec. 3, Figures 3-4; with sequence parallelism,
Korthikanti et al. 2022, sec. 4.2): every weight matrix sharded over the tp ranks, the GPT's own
attention, MLP and block with the parallel layers put in. A layer costs 2 all-reduces forward and
2 backward (Megatron's count), or with SP 2 reduce-scatters and 2 all-gathers of the same bytes.

Saved activations per transformer layer and rank, for this implementation (s = sequence, b = batch,
h = hidden, a = heads, t = tp; in elements; Korthikanti et al.'s Table 2 counts the same way for
Megatron's kernels, with dropout masks and 2-byte values: sbh(10 + 24/t) + 5as²b/t, and sbh·34/t +
5as²b/t with SP). Forward of one block saves:

    ln_1: x̂ (sbh) and 1/σ (sb)                  c_attn: its input, ln_1's output (sbh)
    Q K^T: the qkv buffer (3sbh/t, q, k, v are views of it); scale, mask and softmax are one op
    (Megatron's fused scale-mask-softmax) that saves only its output (as²b/t), which att @ V
    reuses, with v
    c_proj: the heads' output re-laid as (b, s, h/t) (sbh/t)
    ln_2: x̂ (sbh) and 1/σ (sb)                  c_fc: ln_2's output (sbh)
    GELU: its input and its tanh (2 · 4sbh/t)      c_proj: GELU's output (4sbh/t)

TP total: sbh(4 + 16/t) + as²b/t + 2sb; the 4sbh (LayerNorm inputs and outputs) are replicated on
every rank. With SP those live on sequence shards, and each column-parallel layer saves only its
input's shard (AllGatherLinear re-gathers it in backward): sbh·20/t + as²b/t + 2sb/t, all divided
by t. tests/test_tensor_parallel.py measures both at t = 1, 2, 4.

Dropout keeps the sharded model the same function as the unsharded one: where an activation is
replicated (between the regions, without SP) every rank draws the same mask, as one process would;
where it is split (attention probabilities by heads; with SP, the residual stream by sequence) each
rank draws the mask of the whole tensor from the shared generator and keeps its slice
(ParallelDropout, through autograd's Dropout op). Megatron instead forks a per-rank random
stream for the split regions (its RNG tracker): no extra random numbers, but masks no single
process would draw, so it cannot be checked against one. Here the split regions stay exact, and each rank draws
only its slice's numbers (random.rand_at jumps the generator over the rest).
Recomputation (GPTConfig.recompute: "selective" the attention core, "full" each block) replays
those draws, and in "full" the forward's collectives too.

The attention, the MLP and the block are the GPT's own modules (their forward inherited) with
the parallel linears and dropouts put in, so what differs from one process is only the layers.

The embedding is vocab-parallel (each rank a slice of the rows; out-of-slice tokens give zeros,
then g), and the LM head's logits stay split by vocabulary: the vocab-parallel cross-entropy
all-reduces three (B, T) tensors (max, sum of exponentials, target logit) and never gathers the
(B, T, V) logits. The vocabulary is padded to a multiple of t (padded logits are -inf).
"""
import numpy as np

from ... import backend, random
from ...autograd import Tensor
from ...autograd.engine import queue_callback
from ...backend import array_module
from ...comm import all_reduce_coalesced, broadcast, ring_all_gather
from ...nn import Embedding, LayerNorm, Module, ModuleList
from ...nn.gpt import GPT, Block, CausalSelfAttention, FeedForward, aux_loss_term, float_logits
from ..clip import clip_sharded_grad_norm_, sum_of_squares
from ..pipeline.step_end import used_anywhere
from .comms import GatherFromTensorParallelRegion
from .layers import (ColumnParallelLinear, ParallelDropout, RowParallelLinear, VocabParallelCrossEntropy,
                     VocabParallelEmbedding, divide, positions)
from .moe import ReplicatedMoE


class ParallelAttention(CausalSelfAttention):
    """The GPT's causal self-attention on this rank's n_head/t heads: c_attn column-parallel (its Q,
    K and V columns of those heads), c_proj row-parallel. ``forward`` and ``core`` are the GPT's own
    (inherited): they work on however many heads the module has. (``Module.__init__``, not the
    parent's, which would first build the full-size layers.)"""

    def __init__(self, config, comm, sequence_parallel):
        Module.__init__(self)
        self.n_head = divide(config.n_head, comm.size, "n_head")
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, comm, config.bias,
                                           sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(config.n_embd, config.n_embd, comm, config.bias,
                                        sequence_parallel=sequence_parallel)
        self.attn_dropout = ParallelDropout(config.dropout, comm, axis=1)           # split by heads
        self.resid_dropout = ParallelDropout(config.dropout, comm, axis=1 if sequence_parallel else None)
        # selective recomputation redoes the (B, H/t, T, T) core in backward (no collectives in it)
        self.recompute = config.recompute == "selective"
        self._masks = {}


class ParallelMLP(FeedForward):
    """The GPT's MLP with c_fc column-parallel (GELU on the local columns) and c_proj row-parallel:
    one g. ``forward`` is the GPT's own (inherited)."""

    def __init__(self, config, comm, sequence_parallel):
        Module.__init__(self)
        self.c_fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, comm, config.bias,
                                         sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(4 * config.n_embd, config.n_embd, comm, config.bias,
                                        sequence_parallel=sequence_parallel)
        self.dropout = ParallelDropout(config.dropout, comm, axis=1 if sequence_parallel else None)


class ParallelBlock(Block):
    """The GPT's block (LayerNorms replicated, or on sequence shards with SP) around the parallel
    attention and MLP; ``forward`` (with full recomputation) is the GPT's own (inherited). Where the
    config puts an MoE layer (block ``layer``), the MLP is that layer replicated on the tp ranks (moe.py);
    with SP each rank routes its own tokens."""

    def __init__(self, config, comm, sequence_parallel, layer=0):
        Module.__init__(self)
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = ParallelAttention(config, comm, sequence_parallel)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        if config.is_moe_layer(layer):
            self.mlp = ReplicatedMoE(config.n_embd, config.moe_experts, config.moe_top_k, config.moe_capacity_factor,
                                     config.moe_groups, config.moe_aux_loss_coef, config.moe_normalize_gates,
                                     bias=config.bias, dropout=config.dropout)
            if config.recompute == "full":   # as the GPT's block: the aux loss seeded in backward
                self.mlp.aux_loss_scale = 1.0
            if sequence_parallel:            # each tp rank routes its own contiguous piece of the sequence
                self.mlp.token_comm = self.mlp.sequence_comm = comm
                self.mlp.token_layout = "contiguous"
        else:
            self.mlp = ParallelMLP(config, comm, sequence_parallel)
        self.recompute = config.recompute == "full"


class TensorParallelGPT(Module):
    """The GPT with every weight matrix sharded over ``comm`` (see the module docstring).
    ``forward(idx, targets)`` returns (local logits (B, T, V_pad/t), mean loss) or, without
    targets, the full logits (gathered: for sampling). ``full_state_dict()`` gathers the GPT's
    parameters under their unsharded names."""

    def __init__(self, config, comm, sequence_parallel=False):
        super().__init__()
        self.config, self.comm, self.sequence_parallel = config, comm, sequence_parallel
        t = comm.size
        self.padded_vocab = -(-config.vocab_size // t) * t
        self.wte = VocabParallelEmbedding(self.padded_vocab, config.n_embd, comm, sequence_parallel)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = ParallelDropout(config.dropout, comm, axis=1 if sequence_parallel else None)
        self.h = ModuleList([ParallelBlock(config, comm, sequence_parallel, i) for i in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = ColumnParallelLinear(config.n_embd, self.padded_vocab, comm, bias=False,
                                            sequence_parallel=sequence_parallel)
        if config.tie_weights:      # both are (V/t, C), rows [r·V/t, (r+1)·V/t): the same shard, shared
            self.lm_head.weight = self.wte.weight
        # parameters every rank holds whole: with sequence parallelism each sees 1/t of the tokens,
        # so their gradients are partial sums, all-reduced once at the end of backward (an MoE layer's
        # router and experts too: each rank routes its own tokens)
        self.replicated = [q for name, q in self.named_parameters() if name.startswith(("wpe.", "ln_f.")) or
                           ".ln_" in name or name.endswith(("c_proj.bias",)) or ".mlp.router." in name or
                           ".mlp.experts." in name]     # an MoE layer is whole on every rank (moe.py)
        self._pending = False
        # a pipeline runs one backward per micro-batch: it sets this to False and calls
        # all_reduce_replicated_grads() once per step (summing twice would count a micro-batch t times)
        self.reduce_replicated_grads_in_backward = True
        if sequence_parallel:
            for q in self.replicated:
                q.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, q):
        if not self._pending and self.reduce_replicated_grads_in_backward:
            self._pending = True
            queue_callback(self.all_reduce_replicated_grads)

    def all_reduce_replicated_grads(self):
        """With sequence parallelism: one all-reduce of the replicated parameters' gradients
        (partial sums over each rank's tokens), flattened together. Without it, nothing to do. With
        MoE layers an expert this rank's tokens left idle may be another's: it counts as zeros here,
        and one that no tp rank used keeps grad None."""
        if not self.sequence_parallel:
            return
        params = used_anywhere(self.comm, self.replicated) if self.config.moe_experts else self.replicated
        all_reduce_coalesced(self.comm, [q.grad for q in params if q.grad is not None], algorithm="ring")
        self._pending = False

    def clip_grad_norm_(self, max_norm, pipeline_comm=None, loss_scale=1.0):
        """Clip by the norm of the *full* model's gradient: the squares summed over the tp ranks,
        a replicated parameter's counted on tp rank 0 only (Megatron's "not a tensor-parallel
        duplicate"). In a pipeline each rank holds its stage's parameters only (the others have no
        gradient): the stages' squares are summed over ``pipeline_comm`` too. ``loss_scale``: mixed precision's
        gradients are that many times the true ones (the norm is theirs over it)."""
        replicated = {id(q) for q in self.replicated} | {id(q) for q in self.wpe.parameters()}
        grads = [q for q in self.parameters() if q.grad is not None]
        counted = [q.grad for q in grads if id(q) not in replicated or self.comm.rank == 0]
        groups = [self.comm] + ([pipeline_comm] if pipeline_comm is not None else [])
        return clip_sharded_grad_norm_(grads, max_norm, sum_of_squares(counted), groups, loss_scale)

    def forward(self, idx, targets=None, cache=None):
        """With a KV ``cache`` (generation, the GPT's protocol) each rank's cache holds its own heads'
        K/V (n_head/t of them): the attention is already split by heads, so nothing else changes."""
        idx = idx.data if isinstance(idx, Tensor) else idx
        if backend.is_device_array(self.wpe.weight.data) and not backend.is_device_array(idx):
            idx = backend.to_device(idx)                  # tokens from the host: one counted copy
        if cache is not None and self.sequence_parallel:
            raise ValueError("generation with a KV cache runs without sequence parallelism (one new token "
                             "per sequence does not split along the sequence)")
        pos = positions(idx.shape[1], self.comm, self.sequence_parallel, array_module(idx)) if cache is None \
            else cache.positions(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))          # SP: (B, T/t, C)
        for i, block in enumerate(self.h):
            x = block(x) if cache is None else block(x, cache=cache, layer=i)
        if cache is not None:
            cache.advance(idx.shape[1])
        logits = self.lm_head(self.ln_f(x))                   # (B, T, V_pad/t)
        if targets is None:
            full = GatherFromTensorParallelRegion.apply(logits, self.comm)
            return full[..., :self.config.vocab_size]
        loss = self.loss(logits, targets)
        if self.config.moe_experts and self.training:      # as the GPT's forward
            for block in self.h:
                if isinstance(block.mlp, ReplicatedMoE):
                    loss = loss + aux_loss_term(block.mlp)
        return logits, loss

    def loss(self, logits, targets):
        """Mean cross-entropy of the vocab-split logits (never gathered)."""
        targets = targets.data if isinstance(targets, Tensor) else targets
        if tuple(targets.shape) != tuple(logits.shape[:-1]) or targets.dtype.kind not in "iu":
            raise ValueError(f"vocab-parallel cross_entropy: logits {tuple(logits.shape)} need integer targets of "
                             f"shape {tuple(logits.shape[:-1])}, got {targets.dtype} {tuple(targets.shape)}")
        if backend.is_device_array(logits.data) and not backend.is_device_array(targets):
            targets = backend.to_device(targets)           # targets from the host: one counted copy
        return VocabParallelCrossEntropy.apply(float_logits(logits), targets, self.comm, self.wte.start,
                                               self.config.vocab_size)

    # ---- names and shards
    def _shards(self):
        """unsharded name -> (local parameter, axis along which it is split or None)."""
        mapping = {"wte.weight": (self.wte.weight, 0), "wpe.weight": (self.wpe.weight, None),
                   "ln_f.weight": (self.ln_f.weight, None)}
        if not self.config.tie_weights:                       # tied: listed once, as wte (as the GPT does)
            mapping["lm_head.weight"] = (self.lm_head.weight, 0)
        if self.ln_f.bias is not None:
            mapping["ln_f.bias"] = (self.ln_f.bias, None)
        for i, block in enumerate(self.h):
            p = f"h.{i}."
            for name, module in (("ln_1", block.ln_1), ("ln_2", block.ln_2)):
                mapping[p + name + ".weight"] = (module.weight, None)
                if module.bias is not None:
                    mapping[p + name + ".bias"] = (module.bias, None)
            linears = (("attn.c_attn", block.attn.c_attn, "qkv"), ("attn.c_proj", block.attn.c_proj, 1))
            if isinstance(block.mlp, ReplicatedMoE):           # whole on every rank
                for name, q in block.mlp.named_parameters():
                    mapping[p + "mlp." + name] = (q, None)
            else:
                linears += (("mlp.c_fc", block.mlp.c_fc, 0), ("mlp.c_proj", block.mlp.c_proj, 1))
            for name, module, axis in linears:
                mapping[p + name + ".weight"] = (module.weight, axis)
                if module.bias is not None:
                    mapping[p + name + ".bias"] = (module.bias, None if axis == 1 else axis)
        return mapping

    def _slice(self, full, axis, name):
        """This rank's shard of an unsharded array."""
        t, r = self.comm.size, self.comm.rank
        if axis is None:
            return full
        if axis == "qkv":                                     # rows: q, k, v blocks, each by heads
            c = full.shape[0] // 3
            w = c // t
            return np.concatenate([full[j * c + r * w:j * c + (r + 1) * w] for j in range(3)], axis=0)
        if name in ("wte.weight", "lm_head.weight") and full.shape[0] != self.padded_vocab:
            pad = np.zeros((self.padded_vocab - full.shape[0],) + full.shape[1:], full.dtype)
            full = np.concatenate([full, pad], axis=0)
        n = full.shape[axis] // t
        index = [slice(None)] * full.ndim
        index[axis] = slice(r * n, (r + 1) * n)
        return full[tuple(index)]

    def load_full_state_dict(self, state):
        """Take each unsharded parameter's slice (the sharded model then computes the same function)."""
        for name, (q, axis) in self._shards().items():
            full = backend.to_host(state[name])
            q.data = backend.to_device(np.ascontiguousarray(self._slice(full, axis, name))).astype(q.dtype)

    def full_state_dict(self, shards=None):
        """name -> full array, gathered from the shards (a collective on every rank). ``shards``
        (id(parameter) -> array) supplies shards held elsewhere (a pipeline frees other stages')."""
        t = self.comm.size
        state = {}
        for name, (q, axis) in self._shards().items():
            local = backend.to_host(q.data if shards is None else shards[id(q)])
            if axis is None:
                state[name] = local.copy()
                continue
            pieces = ring_all_gather(self.comm, np.ascontiguousarray(local).reshape(-1), total=local.size * t)
            pieces = pieces.reshape((t,) + local.shape)
            if axis == "qkv":
                w = local.shape[0] // 3
                full = np.concatenate([pieces[r][j * w:(j + 1) * w] for j in range(3) for r in range(t)], axis=0)
            else:
                full = np.concatenate(list(pieces), axis=axis)
            if name in ("wte.weight", "lm_head.weight"):
                full = full[:self.config.vocab_size]
            state[name] = full
        return state


def tensor_parallelize(gpt, comm, sequence_parallel=False):
    """The tensor-parallel form of ``gpt`` (an nn.GPT): rank 0's weights are broadcast, then each
    rank keeps its shard of every matrix, in the GPT's dtype (a float16 GPT's shards are float16). Same
    function, same names (``full_state_dict()``)."""
    if not isinstance(gpt, GPT):
        raise TypeError("tensor_parallelize takes an nn.GPT")
    state = {}
    for name, q in gpt.named_parameters():
        state[name] = broadcast(comm, q.data.copy(), root=0)     # every rank shards the same model
    # the shards' own initialisation is overwritten at once: draw it from a copy of the generator, so the
    # dropout masks that follow are the ones one process draws after building the GPT
    with random.use_generator(random.fork()):
        model = TensorParallelGPT(gpt.config, comm, sequence_parallel)
    model.to(gpt.wte.weight.dtype)
    model.load_full_state_dict(state)
    return model

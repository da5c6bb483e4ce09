"""A small decoder-only GPT (Radford et al. 2019, GPT-2's layout, after nanoGPT).

Token + position embeddings, n_layer pre-LayerNorm blocks of causal multi-head
self-attention and a 4x GELU MLP (both with residual connections), a final LayerNorm and the
LM head. Parameter names and shapes match nanoGPT's modules (h.0.attn.c_attn.weight is
(3·n_embd, n_embd)), so weights copy one-to-one into a PyTorch model for the oracle tests.
Parameters per layer: 12·n_embd² + 13·n_embd (with biases). GPTConfig.recompute: "full"
recomputes each block in backward, "selective" only the attention core (Korthikanti et al. 2022).
GPTConfig.moe_experts > 0 puts a mixture of experts in place of some blocks' MLPs (nn/moe.py).
"""
import math
from dataclasses import dataclass

from .. import backend
from ..autograd import Tensor
from ..autograd.checkpoint import checkpoint
from . import functional as F
from . import generation
from .layers import Dropout, Embedding, LayerNorm, Linear, ModuleList
from .module import Module


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False   # share wte.weight with lm_head.weight (GPT-2 does; off by default)
    recompute: str = None       # None, "full" (each block) or "selective" (the attention core)
    # mixture of experts (nn/moe.py): with moe_experts > 0, the MLP of every moe_every-th block
    # (h.{moe_every-1}, h.{2·moe_every-1}, ...) is an MoE layer of that many FeedForward experts
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = None   # None: dropless
    moe_every: int = 1
    moe_aux_loss_coef: float = 0.01
    moe_groups: int = 1                 # GShard's groups: capacity counted per group of tokens
    moe_normalize_gates: bool = False   # True: gates renormalised over the top-k (Mixtral)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.recompute not in (None, "none", "full", "selective"):
            raise ValueError(f"recompute must be None, 'full' or 'selective', got {self.recompute!r}")
        if self.moe_experts < 0:
            raise ValueError(f"moe_experts must be 0 (no MoE layer) or more, got {self.moe_experts}")
        if self.moe_experts:
            if self.moe_every < 1 or self.moe_every > self.n_layer:
                raise ValueError(f"moe_every={self.moe_every} must be in [1, n_layer={self.n_layer}] "
                                 "(no block would be an MoE layer)")

    def is_moe_layer(self, layer):
        """Whether block ``layer`` (0-based) has an MoE layer in place of its MLP."""
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0


class CausalSelfAttention(Module):
    """softmax(Q K^T / sqrt(d) + causal mask) V over n_head heads of size n_embd / n_head."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = Dropout(config.dropout)
        self.resid_dropout = Dropout(config.dropout)
        self.recompute = config.recompute == "selective"
        self._masks = {}

    def causal_mask(self, T, like):
        """True above the diagonal: position t may not look at positions after it."""
        key = (T, backend.is_device_array(like))
        if key not in self._masks:
            xp = backend.array_module(like)
            self._masks[key] = xp.triu(xp.ones((T, T), dtype=bool), k=1)
        return self._masks[key]

    def forward(self, x, cache=None, layer=0):
        """``cache`` (generation, nn/generation.py's KVCache protocol): x holds only the new tokens;
        their K/V go into the cache as layer ``layer``'s, and they attend to everything cached."""
        qkv = self.c_attn(x)                                  # (B, T, 3·H·D)
        B, T, _ = qkv.shape
        H, D = self.n_head, self.head_dim
        q, k, v = qkv.split(H * D, axis=2)
        q = q.reshape(B, T, H, D).transpose(1, 2)            # (B, H, T, D)
        k = k.reshape(B, T, H, D).transpose(1, 2)
        v = v.reshape(B, T, H, D).transpose(1, 2)
        if cache is not None:                                # (B, H, L, D) keys and values, L >= T
            keys, values, mask = cache.append(layer, k.data, v.data)
            y = self.core(q, Tensor(keys), Tensor(values), mask)
        else:
            # selective recomputation (Korthikanti et al. 2022): the core's (B, H, T, T) activations are
            # the largest and the cheapest to recompute, so they are dropped and redone in backward
            y = checkpoint(self.core, q, k, v) if self.recompute else self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, H * D)           # heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v, mask=None):
        """softmax(Q K^T / sqrt(d) + mask), dropout, times V: (B, H, T, D) in and out (keys and
        values (B, H, L, D); ``mask`` True where a query may not look, causal by default)."""
        T, D = q.shape[2], q.shape[3]
        att = q @ k.transpose(-2, -1)                          # (B, H, T, L)
        att = F.softmax(att, axis=-1, scale=1.0 / math.sqrt(D),   # scaled and masked in the same op
                        mask=self.causal_mask(T, q.data) if mask is None else mask)
        att = self.attn_dropout(att)
        return att @ v


class FeedForward(Module):
    """Linear(n_embd, 4 n_embd), GELU, Linear(4 n_embd, n_embd) (nanoGPT's ``MLP``)."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); ``mlp`` is an MoE layer where the config says so."""

    def __init__(self, config, layer=0):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        if config.is_moe_layer(layer):
            from .moe import MoE   # moe.py builds its experts from FeedForward, defined above
            self.mlp = MoE(config.n_embd, config.moe_experts, config.moe_top_k, config.moe_capacity_factor,
                           config.moe_groups, config.moe_aux_loss_coef, config.moe_normalize_gates,
                           bias=config.bias, dropout=config.dropout)
            if config.recompute == "full":   # its aux loss, computed without a graph, is seeded in backward
                self.mlp.aux_loss_scale = 1.0
        else:
            self.mlp = FeedForward(config)
        self.recompute = config.recompute == "full"

    def forward(self, x, cache=None, layer=0):
        if cache is not None:   # generation (no backward): the KV cache is layer ``layer``'s
            return self.compute(x, cache, layer)
        if self.recompute:      # full recomputation: keep only the block's input
            return checkpoint(self.compute, x)
        return self.compute(x)

    def compute(self, x, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), cache=cache, layer=layer)
        return x + self.mlp(self.ln_2(x))


def aux_loss_term(moe):
    """What the loss adds for an MoE layer: its aux_loss, or only its value where the layer seeds the
    gradient itself (moe.aux_loss_scale set: nn/moe.py's AuxLossAutoScaler)."""
    return moe.aux_loss if moe.aux_loss_scale is None else Tensor(moe.aux_loss.data)


def float_logits(logits):
    """float16 / bfloat16 logits in float32 for the loss (Megatron's default, fp16_lm_cross_entropy off): the
    loss times fp16's loss scale (2^16 at first) would overflow 16 bits, and its log-sum-exp round there."""
    return logits.float() if logits.dtype in backend.LOW_PRECISION else logits


class GPT(Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout)
        self.h = ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def _init_weights(self):
        """GPT-2's init: N(0, 0.02) for linear and embedding weights, zero biases, and the
        residual projections scaled by 1/sqrt(2 n_layer)."""
        from .. import random
        for name, p in self.named_parameters():
            if name.endswith(".bias") or name.startswith("ln_") or ".ln_" in name:
                continue
            std = 0.02
            if name.endswith("c_proj.weight"):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            p.data[...] = random.randn(*p.shape, dtype=p.dtype) * std
        for module in self.modules():
            if isinstance(module, Linear) and module.bias is not None:
                module.bias.data[...] = 0

    def forward(self, idx, targets=None, cache=None):
        """Logits (B, T, vocab) for integer tokens ``idx`` (B, T); with ``targets``, (logits, loss).
        With a KV ``cache`` (generation), ``idx`` holds only the tokens new to the cache's sequences.
        With MoE layers, the loss in training mode is the cross-entropy plus every MoE layer's
        load-balancing loss (in eval mode the cross-entropy alone, comparable with a dense model's)."""
        idx = idx.data if isinstance(idx, Tensor) else idx
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        if backend.is_device_array(self.wte.weight.data) and not backend.is_device_array(idx):
            idx = backend.to_device(idx)                  # tokens from the host: one counted copy
        pos = backend.array_module(idx).arange(T) if cache is None else cache.positions(T)   # (T) or (B, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.h):
            x = block(x) if cache is None else block(x, cache=cache, layer=i)
        if cache is not None:
            cache.advance(T)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(float_logits(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if self.config.moe_experts and self.training:
            for i, block in enumerate(self.h):
                if self.config.is_moe_layer(i):
                    loss = loss + aux_loss_term(block.mlp)
        return logits, loss

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, rng=None, cache="contiguous"):
        """Sample ``max_new_tokens`` tokens after the context ``idx`` (B, T) (``temperature`` 0: greedy),
        with a KV cache: "contiguous" (default), None (recompute the prefix for every token), or a
        paged one from minitrain.inference (nn/generation.py)."""
        return generation.generate(self, idx, max_new_tokens, temperature, top_k, rng, cache)

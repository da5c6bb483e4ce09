"""What the planner plans a layout for: the model by its sizes, as the jobs build it.

MLP is nn.MLP(sizes) (the digits job), GPT nanoGPT's layout with its optional mixture of
experts (nn.GPT), Params a model known only by its parameter count (plan params). Each
counts its parameters; the MLP lists the modules a pipeline cuts into stages. layout.py says how
ranks share the work.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class MLP:
    """``nn.MLP(sizes)``: Linear layers with ReLU between them (the digits job: 64 in, 10 out)."""
    sizes: tuple
    kind = "mlp"

    def linears(self):
        return list(zip(self.sizes[:-1], self.sizes[1:]))

    def num_parameters(self):
        return sum(i * o + o for i, o in self.linears())

    def modules(self):
        """The Sequential's modules as (kind, in, out): what a pipeline cuts into stages."""
        out = []
        for j, (i, o) in enumerate(self.linears()):
            out.append(("linear", i, o))
            if j < len(self.sizes) - 2:
                out.append(("relu", o, o))
        return out


@dataclass(frozen=True)
class GPT:
    """nanoGPT's layout (minitrain.nn.GPT): V vocabulary, s = block_size, L layers, a heads, h width;
    ffn_hidden f the MLP's hidden width (default 4h). With moe_experts E > 0 the MLP of every
    moe_every-th block is a mixture of experts (nn/moe.py, plan/experts.py): a router Linear(h, E)
    without bias, E routed experts (the GPT's MLP of width expert_hidden, default f) of which each
    token takes top_k, and moe_shared always-on experts of that width (DeepSeek's shared expert)."""
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    ffn_hidden: int = 0                 # 0: 4h
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity_factor: float = None   # None: dropless
    moe_groups: int = 0                 # GShard's groups over the global batch (capacity counted per group);
                                        # 0: one per replica and micro-batch, the job's default
    expert_hidden: int = 0              # 0: ffn_hidden
    moe_shared: int = 0
    kind = "gpt"

    @property
    def ffn(self):
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def expert_ffn(self):
        return self.expert_hidden or self.ffn

    def is_moe_layer(self, layer):
        """As nn.GPTConfig: blocks moe_every-1, 2·moe_every-1, ... (0-based)."""
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0

    def num_moe_layers(self):
        return self.n_layer // self.moe_every if self.moe_experts else 0

    def num_parameters(self):
        """12Lh² + 13Lh (blocks, f = 4h) + (V + s)h (embeddings) + 2h (ln_f) + Vh (untied LM head); an MoE
        block's MLP is its router hE and (E + shared) experts of 2hf' + f' + h each."""
        h, L, V, s, f = self.n_embd, self.n_layer, self.vocab_size, self.block_size, self.ffn
        moe, fe = self.num_moe_layers(), self.expert_ffn
        mlp = 2 * h * f + f + h
        expert = 2 * h * fe + fe + h
        return (L * (4 * h * h + 8 * h + mlp) + moe * (h * self.moe_experts + (self.moe_experts + self.moe_shared)
                * expert - mlp) + (V + s) * h + 2 * h + V * h)


@dataclass(frozen=True)
class Params:
    """A model known only by its parameter count (``plan params``): model states, no activations."""
    num_params: int
    kind = "params"

    def num_parameters(self):
        return self.num_params

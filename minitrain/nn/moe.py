"""A mixture-of-experts layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al.
2022): route -> dispatch -> experts -> combine, in place of a transformer block's MLP.

The router, Linear(C, E) without bias, gives each token softmax probabilities over E experts; the
token goes to its k most probable experts (top-k), each expert the GPT's FeedForward. Gates (Switch's):
the chosen experts' softmax probabilities as they are, so even with k = 1 the language loss trains
the router through them; normalize_gates=True divides them by their sum (GShard's top-2, Mixtral's
softmax over the top-k logits: the same numbers). With a capacity factor an expert takes at most
ceil(factor · N/G · k / E) choices per group of N/G tokens, first choices before second ones
(moe_dispatch.py); the rest are dropped. The load-balancing loss (Switch, eq. 4) is
alpha · E · sum_i f_i · P_i, f_i the fraction of the k·N choices routed to expert i (before
dropping), P_i the mean router probability of expert i, averaged over the groups: 1 · alpha when
perfectly balanced, E · alpha when one expert takes everything. Parameters: E · 8C² (+ biases) + C·E.

Where the loss cannot simply add aux_loss (a block recomputed in backward computes it without a graph;
a pipeline stage other than the last has no loss), aux_loss_scale s makes the layer return
AuxLossAutoScaler.apply(y, aux_loss, s) (Megatron-Core's MoEAuxLossAutoScaler): y unchanged, and in
backward aux_loss's gradient seeded with s, as if s · aux_loss had been added to the loss.
"""
from collections import namedtuple

from .. import backend
from ..autograd import Function, Tensor, cat
from . import functional as F
from .gpt import FeedForward
from .layers import Linear, ModuleList
from .module import Module
from .moe_dispatch import capacity, combine, dispatch, plan_dispatch

_ExpertShape = namedtuple("_ExpertShape", "n_embd bias dropout")   # the fields FeedForward reads


class MoE(Module):
    """``experts`` is a ModuleList of FeedForward: parameter names read experts.3.c_fc.weight. After each
    forward, ``aux_loss`` holds the load-balancing loss (a Tensor in the graph, for the training loss)
    and ``stats`` what the step's report needs (``statistics()`` reads it on the host)."""

    #: what backward's seed of the main loss is multiplied by (mixed precision's loss scale; Megatron's
    #: MoEAuxLossAutoScaler.set_loss_scale): a seeded aux loss's gradient is scaled alike
    main_loss_backward_scale = 1.0

    def __init__(self, n_embd, num_experts, top_k=2, capacity_factor=None, groups=1, aux_loss_coef=0.01,
                 normalize_gates=False, bias=True, dropout=0.0):
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"moe: need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"moe: capacity_factor must be positive (None: dropless), got {capacity_factor}")
        if groups < 1:
            raise ValueError(f"moe: groups must be at least 1, got {groups}")
        self.num_experts, self.top_k, self.groups = num_experts, top_k, groups
        self.capacity_factor, self.aux_loss_coef, self.normalize_gates = capacity_factor, aux_loss_coef, normalize_gates
        self.router = Linear(n_embd, num_experts, bias=False)
        self.experts = ModuleList([FeedForward(_ExpertShape(n_embd, bias, dropout)) for _ in range(num_experts)])
        self.aux_loss, self.stats = None, None
        self.aux_loss_scale = None     # None: the model adds aux_loss to its loss; s: seeded in backward
        self.rows_routed = self.rows_taken = 0    # N·k choices, and the rows its experts took (capacity: fewer)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # (N, C): every token of the batch
        self.rows_routed += x.shape[0] * self.top_k                    # (the jobs read and reset the counts)
        probs = F.softmax(self.router(x), axis=-1)                     # (N, E)
        choices, gates = self.route(probs)
        plan = self.plan(choices, shape)
        y = combine(self.run_experts(dispatch(x, plan), plan.counts), gates, plan)
        self.aux_loss = self.load_balancing_loss(probs, plan)
        self.stats = {"load": plan.routed.sum(axis=0), "dropped": plan.dropped, "aux_loss": self.aux_loss.data}
        if self.aux_loss_scale is not None:
            y = AuxLossAutoScaler.apply(y, self.aux_loss, scale=self.aux_loss_scale * self.main_loss_backward_scale)
        return y.reshape(shape)

    def route(self, probs):
        """Each token's k experts, most probable first (N, k integers), and their gates (N, k Tensor)."""
        xp = backend.array_module(probs.data)
        choices = backend.argsort(-probs.data, axis=-1)[:, :self.top_k]
        gates = probs[xp.arange(probs.shape[0])[:, None], choices]
        if self.normalize_gates:
            gates = gates / gates.sum(axis=-1, keepdims=True)
        return choices, gates

    def plan(self, choices, shape):
        """Where each choice goes: plan_dispatch over this layer's groups, at its capacity (``shape``: the
        input's, (..., C); a layer whose tokens are spread over ranks plans with theirs)."""
        return plan_dispatch(choices, self.num_experts, self.capacity(choices.shape[0]), self.groups)

    def capacity(self, num_tokens):
        return capacity(self.capacity_factor, num_tokens // self.groups, self.top_k, self.num_experts)

    def run_experts(self, rows, counts):
        """Expert i on its counts[i] consecutive rows (an expert with none is skipped). No rows at all (a rank
        routing its own tokens under cp or sp, every choice of which a capacity dropped): the (0, C) rows are
        the output, carrying the graph."""
        self.rows_taken += sum(counts)
        pieces = rows.split(counts, axis=0)
        outputs = [expert(piece) for expert, piece, n in zip(self.experts, pieces, counts) if n]
        return cat(outputs, axis=0) if outputs else rows

    def load_balancing_loss(self, probs, plan):
        """alpha · E · sum_i f_i · P_i per group, averaged over the groups (Switch's eq. 4 with f over the
        k·N choices). f is counted, so its gradient is zero: the router learns balance through P. In fp32 for
        16-bit probabilities, as the cross-entropy: its gradient times the loss scale and alpha·E overflows fp16."""
        G, E = self.groups, self.num_experts
        S = probs.shape[0] // G
        probs = probs.float() if probs.dtype in backend.LOW_PRECISION else probs
        f = self.choice_fractions(plan, S, probs.dtype)                         # (G, E)
        P = self.mean_probs(probs.reshape(G, S, E).mean(axis=1))
        return (P * f).sum() * (self.aux_loss_coef * E / G)

    def mean_probs(self, P):
        """P: each group's mean router probability per expert (G, E), as this layer's tokens give it (a layer
        whose groups' tokens are spread over ranks that do not average their losses means them over the ranks)."""
        return P

    def choice_fractions(self, plan, tokens_per_group, dtype):
        """f: the fraction of each group's k·S choices routed to each expert (G, E), before dropping."""
        return Tensor((plan.routed / (tokens_per_group * self.top_k)).astype(dtype))

    def statistics(self):
        """The last forward's load per expert, load_max_over_mean, tokens_dropped (choices over capacity)
        and aux_loss, as host numbers (read from the device)."""
        load = backend.to_host(self.stats["load"])
        return {"load": load.tolist(), "load_max_over_mean": float(load.max() / load.mean()),
                "tokens_dropped": int(self.stats["dropped"]), "aux_loss": float(backend.to_host(self.stats["aux_loss"]))}

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
                f"groups={self.groups}, aux_loss_coef={self.aux_loss_coef}, normalize_gates={self.normalize_gates}")


class AuxLossAutoScaler(Function):
    """Identity on ``y``; backward also returns ``scale`` as the gradient of ``aux_loss`` (a scalar)."""

    @staticmethod
    def forward(ctx, y, aux_loss, scale=1.0):
        ctx.scale, ctx.aux = scale, (aux_loss.shape, aux_loss.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.aux
        return grad, backend.array_module(grad).full(shape, ctx.scale, dtype=dtype)

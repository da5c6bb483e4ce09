"""The mixture of experts inside GPT3D (dp x pp x tp, ep = 1): replicated over the tensor-parallel
ranks, its balancing loss carried by the activations through a pipeline (Megatron-Core's
MoEAuxLossAutoScaler; Switch, Fedus et al. 2022, for the loss itself).

Tensor parallelism: the MoE layer is *replicated* on a stage's tp ranks. Without sequence parallelism
the MLP's input, ln_2's output, is the same on every tp rank (the attention's g all-reduced it), so each
rank routes the same tokens to the same experts and computes the same output: no communication in or
out of the layer.
Backward, the gradient arriving from the residual stream is also whole on every rank, so every expert
and router gradient is whole and identical on the tp ranks (no all-reduce either, and like a
LayerNorm's, counted once in the global gradient norm). The cost: every tp rank stores all the experts
and computes them all, t times the MoE layer's work; an expert-parallel layout (--ep) divides that.

With sequence parallelism (Megatron-Core's way, which it requires for MoE under tp) ln_2's output is
each tp rank's contiguous 1/t of every row's positions, and each rank routes its own tokens, as a cp rank
does (below): the balancing loss's f and a capacity counted over the group's tokens on every tp rank. P,
the group's mean probability per expert, is the ranks' mean: an all-reduce forward with an identity
backward (Megatron's g), so every tp rank's balancing loss is the group's, the same number (tp ranks do
not average their losses, as cp ranks do), and each rank's router gradient is its tokens' share, 1/t of
the loss's pull through P. Each rank's experts see its tokens only: their and the router's gradients are
partial sums, summed over tp with the LayerNorms' (TensorParallelGPT.all_reduce_replicated_grads), an
expert that no tp rank used keeping none. The step's load and drops are summed over tp.

Pipelines: the load-balancing loss of a layer on stage 0 cannot be added to the loss, which only the
last stage computes. AuxLossAutoScaler.apply(y, aux_loss, scale) (nn/moe.py) returns y unchanged; in
backward it passes y's gradient on and also seeds aux_loss's gradient with scale (not 1), so
aux_loss joins the gradient exactly as if it had been added to the loss with that weight: 1/m for each
of the m micro-batches, the weight the pipeline gives each micro-batch's loss (the dp replicas are
averaged by the gradients' all-reduce, as the loss is). The same seeding makes full recomputation
work: the block's forward redone in backward records the graph that its first, graph-less forward
did not. The reported figures are accumulated here per step and gathered over the stages and
replicas by GPT3D (moe_step_statistics).

Context parallelism (token_comm, the cp ranks): each rank routes the tokens it holds; the balancing
loss's fractions and a capacity are counted over a group's tokens on every cp rank (context_parallel/moe.py).
With sequence parallelism too, token_comm is the cp x tp ranks, and each cp rank's positions are cut by tp.
"""
import numpy as np

from ... import backend
from ...autograd import is_grad_enabled
from ...comm import all_reduce
from ...nn.moe import MoE
from ..context_parallel.moe import choice_fractions, plan_for_rank
from .comms import ReduceFromTensorParallelRegion


class ReplicatedMoE(MoE):
    """nn.MoE with the same parameters and names (router, experts.i.c_fc, ...), on every tp rank whole.
    ``aux_loss_scale`` (nn.MoE's): None, the model's forward adds ``aux_loss`` to its loss; a number, the
    layer seeds it in backward (AuxLossAutoScaler). GPT3D sets it to 1/m and ``record_step``: then each
    forward that records a graph adds its figures (load, dropped, aux_loss · scale) to the step's, until
    reset_step(). (Under full recomputation that is the forward redone in backward: counted once.)"""

    token_comm = None       # cp / sp: the ranks holding the rest of each row (GPT3D, ParallelBlock set it)
    token_layout = None     # and how the sequence is laid out over the cp ranks (context_parallel/moe.py)
    sequence_comm = None    # sequence parallelism: the tp ranks, each a contiguous piece of every position held

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_step = False
        self.reset_step()

    def choice_fractions(self, plan, tokens_per_group, dtype):
        if self.token_comm is None or self.token_comm.size == 1:
            return super().choice_fractions(plan, tokens_per_group, dtype)
        return choice_fractions(self, plan, tokens_per_group, dtype, self.token_comm)

    def plan(self, choices, shape):
        if self.token_comm is None or self.token_comm.size == 1 or self.capacity_factor is None:
            return super().plan(choices, shape)                # dropless: each rank's tokens on their own
        return plan_for_rank(self, choices, shape, self.token_comm, self.token_layout, self.sequence_parallel_size)

    @property
    def sequence_parallel_size(self):
        return 1 if self.sequence_comm is None else self.sequence_comm.size

    def mean_probs(self, P):
        """Under sequence parallelism the tp ranks' mean P (each rank's P of its tokens), identity backward."""
        if self.sequence_parallel_size == 1:
            return P
        return ReduceFromTensorParallelRegion.apply(P, self.sequence_comm) / self.sequence_comm.size

    def reset_step(self):
        self.step_figures = []

    def forward(self, x):
        y = super().forward(x)
        if self.record_step and is_grad_enabled():
            self.step_figures.append((self.stats["load"], self.stats["dropped"],
                                      self.aux_loss.data * self.aux_loss_scale))
        return y

    def step_row(self):
        """This step's load per expert (summed over the forwards), tokens dropped and weighted aux loss,
        as one host row of E + 2 numbers (zeros where the layer did not run: another stage's)."""
        row = np.zeros(self.num_experts + 2)
        for load, dropped, aux in self.step_figures:
            row += np.concatenate([backend.to_host(load), [dropped, float(backend.to_host(aux))]])
        return row


def moe_step_statistics(layers, pp_comm, dp_comm, sequence_comm=None):
    """(load_max_over_mean, tokens_dropped, aux_loss) of the step over the global batch, on every rank:
    each layer's load summed over micro-batches and replicas (max over mean per layer, the largest over
    the layers), drops summed, the weighted balancing losses summed over layers and micro-batches and
    averaged over the replicas, as one process sums its layers' losses. ``layers``: every MoE layer of
    the model, in order (one row each: a stage's rows for other stages' layers are zeros). Under sequence
    parallelism (``sequence_comm``, the tp ranks) load and drops are summed over tp too; the balancing loss
    is already the group's on every tp rank."""
    rows = np.stack([layer.step_row() for layer in layers])            # (layers, E + 2)
    if sequence_comm is not None and sequence_comm.size > 1:
        rows[:, :-1] = all_reduce(sequence_comm, np.ascontiguousarray(rows[:, :-1]), op="sum")
    rows = all_reduce(pp_comm, rows.reshape(-1), op="sum")             # the stages' layers
    rows = all_reduce(dp_comm, rows, op="sum").reshape(len(layers), -1)
    loads = rows[:, :-2]
    return (float((loads.max(axis=1) / loads.mean(axis=1)).max()), int(round(rows[:, -2].sum())),
            float(rows[:, -1].sum()) / dp_comm.size)

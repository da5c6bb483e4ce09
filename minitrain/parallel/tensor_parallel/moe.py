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
expert that no tp rank used keeping none. The step's load and drops are summed over tp. Dropout
stays one process's, as ParallelDropout keeps it elsewhere: one process draws each expert's mask over all
its rows, so each rank plans the group's dispatch (as for a capacity) to learn where its rows sit among
them, draws the whole mask and keeps its rows (ExpertRowsDropout), an expert with none here included.

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
from ...autograd import cat, is_grad_enabled, ops
from ...comm import all_reduce
from ...nn import functional as F
from ...nn.module import Module
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
        self.planned = None
        self.reset_step()
        for expert in self.experts:     # under sp / cp, one process's masks over an expert's rows (run_experts)
            expert.dropout = ExpertRowsDropout(expert.dropout.p)

    def choice_fractions(self, plan, tokens_per_group, dtype):
        if self.token_comm is None or self.token_comm.size == 1:
            return super().choice_fractions(plan, tokens_per_group, dtype)
        return choice_fractions(self, plan, tokens_per_group, dtype, self.token_comm)

    def plan(self, choices, shape):
        if self.token_comm is None or self.token_comm.size == 1 or (self.capacity_factor is None
                                                                   and not self.drops_out()):
            self.planned = super().plan(choices, shape)        # dropless: each rank's tokens on their own
        else:
            self.planned = plan_for_rank(self, choices, shape, self.token_comm, self.token_layout,
                                         self.sequence_parallel_size, whole_rows=self.drops_out())
        return self.planned

    def drops_out(self):
        return self.training and self.experts[0].dropout.p > 0

    def run_experts(self, rows, counts):
        """With the plan of a group's tokens over ranks (plan_for_rank), expert i runs wherever the group has rows
        for it, here on this rank's counts[i] (maybe none): its dropout draws the mask of all the group's rows for
        it, as one process does, and keeps this rank's (the generator stays in step with the other ranks')."""
        whole = self.planned
        if whole.whole_counts is None or not self.drops_out():
            return super().run_experts(rows, counts)
        self.rows_taken += sum(counts)
        outputs, start = [], 0
        for expert, piece, n, total in zip(self.experts, rows.split(counts, axis=0), counts, whole.whole_counts):
            if total:
                expert.dropout.rows = (total, whole.whole_rows[start:start + n])
                outputs.append(expert(piece))
                expert.dropout.rows = None
            start += n
        return cat(outputs, axis=0)

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


class ExpertRowsDropout(Module):
    """nn.Dropout for an expert's rows; while ``rows`` = (total, index) is set, they are the rows ``index`` of the
    expert's ``total`` rows over the ranks: the whole mask drawn from the shared generator, these rows kept."""

    def __init__(self, p):
        super().__init__()
        self.p, self.rows = p, None

    def forward(self, x):
        if self.rows is None or not self.training or self.p == 0.0:
            return F.dropout(x, self.p, self.training)
        total, index = self.rows
        return ops.Dropout.apply(x, self.p, full_shape=(total,) + tuple(x.shape[1:]), index=(index,))


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

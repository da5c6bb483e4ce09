"""3D parallelism on the GPT: tensor parallelism inside a pipeline stage, pipeline parallelism
across stages, data parallelism across replicas (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.3 and Figure 2's layout).

Nothing new is computed here: the pieces already exist and only meet.

* DeviceMesh(comm, dp=, pp=, tp=) gives each rank three communicators (tp innermost: a stage's
  tensor-parallel ranks are neighbours, as they share the most traffic).
* tensor_parallelize shards the GPT over the tp communicator.
* The sharded GPT is laid out as a sequence of layers, [embedding, block 0, ..., block L-1, head],
  and PipelineParallel cuts it into stages over the pp communicator and runs a schedule
  (GPipe, 1F1B, interleaved, or the zero-bubble ZB-H1 and ZB-V of Qi et al. 2024, zbv's V putting
  the embedding and the head on the first rank). Within a stage the tp ranks run the same schedule in
  lockstep, so their collectives line up; activations go to the next stage's rank with the same tp
  coordinate.
* Zero-bubble schedules split each backward into B and W (autograd.defer_weight_grads): the nodes
  with a weight among their inputs run twice, for the input's gradient in B, for the weights' in W.
  The f/g collectives have no weight, so they stay in B; sequence parallelism's AllGatherLinear does
  its reduce-scatter in B and its re-gather in W, on every tp rank alike (no byte is sent twice).
* With cp > 1 (context parallelism, context_parallel/gpt.py) each rank takes T/cp positions of every
  row (zig-zag for the ring, contiguous for Ulysses), its blocks' attention runs over the cp
  communicator, and the pipeline's activations are the local chunk (b, T/cp, C). Each rank's loss
  is the mean over its tokens (the cp ranks hold as many each), so averaging over dp x cp (the
  mesh's "dp_cp" communicator, in place of dp's) gives the global batch's mean and its gradient.
* Gradients are averaged over the dp communicator once per step (the pipeline does it after
  the last micro-batch); with sequence parallelism the replicated parameters' partial gradients
  are summed over tp once per step too (not once per micro-batch's backward).

* zero=1|2|3: ZeRO over the dp communicator (zero_3d.py) instead of the all-reduce: the optimizer
  state (1), the gradients (2) and the parameters (3) of each stage sharded over its dp replicas;
  optimizer(optim.AdamW, ...) builds the optimizer (sharded or not) the job steps. With MoE layers its
  optimizer steps each parameter's run of the shard apart, an expert no token chose left alone.

fp16 / bf16 parameters (mixed precision, mixed_precision_3d.py): optimizer() keeps fp32 master weights,
train_step seeds backward with the loss scale over dp x cp and sums the replicas' gradients, clip_grad_norm_
divides the scale out, and every rank of the mesh skips a step any rank's gradient overflowed.

Every rank ends the step with the gradient of the mean loss over the global batch, so training
is the single-process GPT's (tests/test_gpt_3d.py, float64), dropout's masks included (each rank draws its
piece of one process's, dropout_masks.py; with MoE layers, within a replica and a micro-batch). Not combined:
tied embeddings across the first and last stage would need Megatron's extra embedding all-reduce (a clear error).

A GPT with MoE layers (GPTConfig.moe_experts, ep = 1): each MoE layer is replicated on its stage's
tp ranks (with sequence parallelism each routes its own piece of the sequence: its token group the tp
ranks, or cp x tp, the mesh's "cp_tp"; load, drops and idle experts summed over tp too), and its
balancing loss reaches the gradient from any stage through AuxLossAutoScaler (nn/moe.py,
tensor_parallel/moe.py). GShard's groups are cut per micro-batch: the GPT's moe_groups G counts
groups in the global batch, so G must be a multiple of dp·m and each micro-batch of each replica
routes its G/(dp·m) whole groups; one process given the same G counts capacity over the same tokens
and computes the same balancing loss (tests/test_moe_3d.py). train_step's loss is the cross-entropy
plus the balancing losses, as the GPT's, and moe_statistics the step's figures from every stage.
With ep > 1 (expert_parallel_3d.py) each MoE layer's experts are sharded over blocks of ep dp replicas of
the stage and tp coordinate (all-to-all dispatch); the experts' gradients are reduced over the replicas
that hold the same ones, the dense ones over dp as before.
"""

import numpy as np

from ..autograd import Tensor
from ..backend import array_module
from ..comm import DeviceMesh, all_reduce, broadcast
from ..nn import Module, Sequential
from .pipeline import PipelineParallel
from .pipeline.schedules import default_chunks
from .context_parallel.gpt import METHODS as CP_LAYOUTS, context_parallelize, sequence_positions
from .dropout_masks import MaskStream, place_dropouts
from .tensor_parallel import positions, tensor_parallelize
from .zero_3d import Zero3D
from .mixed_precision_3d import is_mixed, mixed_precision_optimizer
from .expert_data_parallel import reduce_expert_gradients
from .expert_parallel_3d import ExpertZero, clip_grad_norm_ as ep_clip_grad_norm_, gather_experts, shard_experts_3d
from .tensor_parallel.moe import ReplicatedMoE, moe_step_statistics


class EmbeddingStage(Module):
    """The pipeline's first layer: token (vocab-parallel) + position embeddings, then dropout."""

    def __init__(self, model):
        super().__init__()
        self.comm, self.sequence_parallel = model.comm, model.sequence_parallel
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.cp_positions = None                         # context parallelism: the positions this rank holds

    def forward(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else idx
        pos = positions(idx.shape[1], self.comm, self.sequence_parallel, array_module(idx))
        if self.cp_positions is not None:
            pos = array_module(idx).asarray(self.cp_positions)[pos]
        return self.drop(self.wte(idx) + self.wpe(pos))


class HeadStage(Module):
    """The pipeline's last layer: the final LayerNorm and the vocab-parallel LM head (logits stay
    split by vocabulary; the loss is the vocab-parallel cross-entropy)."""

    def __init__(self, model):
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class GPT3D:
    """The GPT over ``DeviceMesh(comm, dp=dp, pp=pp, tp=tp)``. ``train_step(idx, targets)`` takes the
    *global* batch (the same on every rank; each data-parallel replica uses its rows), leaves in
    each local parameter's ``.grad`` the gradient of the global mean loss and returns that loss;
    ``eval_step(idx, targets)`` returns the eval-mode loss by the forward alone (gpt_3d_eval.py).
    ``parameters()`` are this rank's (its stage's, its tensor-parallel shards); ``optimizer(cls, ...)``
    builds the optimizer over them (with ``zero``, over this rank's ZeRO shard of them);
    ``full_state_dict()`` gathers the GPT's parameters under their unsharded names."""

    def __init__(self, gpt, comm, dp=1, pp=1, tp=1, schedule="1f1b", num_microbatches=1, chunks=1,
                 sequence_parallel=False, zero=0, cp=1, cp_method="ring", ep=1):
        self.mesh = DeviceMesh(comm, dp=dp, pp=pp, tp=tp, cp=cp)
        self.comm, self.dp, self.pp, self.tp, self.rank = comm, dp, pp, tp, comm.rank
        self.scaler = None                   # mixed precision: what holds the loss scale (mixed_precision_3d)
        # 16-bit gradients: each replica's divided by the dp x cp replicas before they are summed (PyTorch
        # DDP's and Megatron's order: no partial sum exceeds the global gradient, fp16's range is one process's)
        self.pre_divide = is_mixed(list(gpt.parameters()))
        self.cp, self.cp_method = cp, cp_method
        if pp > 1 and gpt.config.tie_weights:
            raise ValueError(f"[rank {comm.rank}] tied embeddings with pp = {pp}: wte lives on the first stage and "
                             f"lm_head on the last; sharing them would need Megatron's embedding all-reduce")
        # chunks=1, the default, means the schedule's own: zbv's V is 2 per rank (any other count is refused)
        chunks = default_chunks(schedule, None if schedule == "zbv" and chunks == 1 else chunks)
        layers = gpt.config.n_layer + 2
        if layers < pp * chunks:
            raise ValueError(f"[rank {comm.rank}] {gpt.config.n_layer} blocks + embedding + head = {layers} layers "
                             f"cannot fill pp x chunks = {pp * chunks} pipeline stages"
                             + (" (zbv's V: 2 chunks per rank)" if schedule == "zbv" else ""))
        self.groups = gpt.config.moe_groups if gpt.config.moe_experts else 1
        if gpt.config.moe_experts and self.groups % (dp * num_microbatches):
            raise ValueError(f"[rank {comm.rank}] moe_groups {self.groups} is not a multiple of dp x micro-batches = "
                             f"{dp} x {num_microbatches}: each micro-batch routes whole capacity groups")
        self.model = tensor_parallelize(gpt, self.mesh.comm("tp"), sequence_parallel=sequence_parallel)
        self.model.reduce_replicated_grads_in_backward = False     # once per step, below
        self.ep, self.ep_comm, self.expert_dp_comm, self.experts = ep, None, None, []
        if ep > 1:                                                  # expert_parallel_3d.py
            self.ep_comm, self.expert_dp_comm, _, self.experts = shard_experts_3d(self.model, self.mesh.comm("dp"), ep)
            if cp > 1:              # the same experts are held by the ep groups of every cp coordinate too
                self.expert_dp_comm = self.mesh.comm("dp_cp").split(self.mesh.coordinate("dp") % ep)
        self.moe_layers = [block.mlp for block in self.model.h if isinstance(block.mlp, ReplicatedMoE)]
        for layer in self.moe_layers:      # a micro-batch's share of the groups; its loss weighs 1/m
            layer.groups, layer.aux_loss_scale = self.groups // (dp * num_microbatches), 1.0 / num_microbatches
            layer.record_step = True
            if cp > 1:                     # each routes its tokens; f and a capacity over the group's on every cp rank
                layer.token_comm, layer.token_layout = self.mesh.comm("cp"), CP_LAYOUTS[cp_method]
            if sequence_parallel:          # and each tp rank its piece of the cp rank's (tensor_parallel/moe.py)
                layer.sequence_comm, layer.token_comm = self.mesh.comm("tp"), self.mesh.comm("cp_tp")
                layer.token_layout = CP_LAYOUTS[cp_method] if cp > 1 else "contiguous"
        self.moe_statistics = None
        self.masks = MaskStream.of(gpt, moe=bool(self.moe_layers))     # one process's dropout masks (dropout_masks.py)
        self.cp_cores = context_parallelize(self.model, self.mesh.comm("cp"), cp_method, self.masks) if cp > 1 else []
        if cp == 1:
            place_dropouts(self.model, self.masks)
        self.layers = Sequential(EmbeddingStage(self.model), *self.model.h, HeadStage(self.model))
        self.pipe = PipelineParallel(self.layers, self.mesh.comm("pp"), schedule, num_microbatches=num_microbatches,
                                     chunks=chunks, dp_comm=self.mesh.comm("dp_cp"),
                                     find_unused_parameters=bool(self.moe_layers),   # an idle expert: no grad
                                     dp_excluded=self.experts)
        self.pipe.on_microbatch = self.masks.begin_microbatch
        if self.expert_dp_comm is not None and self.expert_dp_comm.size > 1:
            for q in self.local_experts:                           # the expert data-parallel replicas start equal
                broadcast(self.expert_dp_comm, q.data, root=0)
        self.zero = self._shard_over_dp(zero, schedule)
        if self.pre_divide:
            self.pipe.dp_reduce_op = "sum"

    def _shard_over_dp(self, stage, schedule):
        """ZeRO stage ``stage`` over the dp communicator (None for 0): it reduce-scatters the gradients."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {stage}")
        if not stage:
            return None
        if schedule == "pipedream_2bw":
            raise ValueError("ZeRO with pipedream_2bw: the stashed weights W(t-1) would be a second, unsharded copy")
        self.pipe.all_reduce_dp_gradients = False
        if self.ep > 1:                      # the experts' own ZeRO over the ranks that hold the same ones
            experts = self.local_experts
            return ExpertZero(Zero3D(self.pipe.dp_parameters(), self.pipe.dp_comm, stage),
                              Zero3D(experts, self.expert_dp_comm, stage, per_parameter=True) if experts else None,
                              self.ep)
        return Zero3D(self.pipe.parameters(), self.pipe.dp_comm, stage,       # over the replicas it reduced over (dp x cp)
                      per_parameter=bool(self.moe_layers))                 # an expert no token chose: grad None

    def optimizer(self, optimizer_class, init_scale=2.0 ** 16, **defaults):
        """The optimizer to step: ``optimizer_class`` on this rank's parameters, or with ZeRO on its shard. With
        float16 / bfloat16 parameters on fp32 master weights, every rank skipping the same steps, fp16's loss
        scale starting at ``init_scale`` (mixed_precision_3d.py); train_step and clip_grad_norm_ use its scale."""
        if is_mixed(self.parameters()):
            opt, self.scaler = mixed_precision_optimizer(self, optimizer_class, init_scale, **defaults)
            return opt
        if self.zero is None:
            return optimizer_class(self.parameters(), **defaults)
        return self.zero.optimizer(optimizer_class, **defaults)

    def parameters(self):
        return self.pipe.parameters()

    @property
    def loss_scale(self):
        """What backward multiplies the loss by: mixed precision's scale (fp16's dynamic one), else 1."""
        return 1.0 if self.scaler is None else self.scaler.loss_scale

    def zero_grad(self):
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            self.pipe.zero_grad()

    def replica_batch(self, idx, targets):
        """(idx, targets, rows) of this rank: its replica's contiguous rows (where dp does not divide n the first
        n % dp take one more; a replica may take none) and, under cp, its positions of them. With MoE layers the
        batch must split into whole capacity groups."""
        n, d = len(idx), self.mesh.coordinate("dp")
        if n % self.groups:
            raise ValueError(f"[rank {self.rank}] a batch of {n} rows does not split into "
                             f"moe_groups {self.groups} groups of whole rows")
        start = d * (n // self.dp) + min(d, n % self.dp)
        rows = slice(start, start + n // self.dp + (1 if d < n % self.dp else 0))
        idx, targets = idx[rows], targets[rows]
        self.masks.replica_start = start
        if self.cp > 1:                                           # this rank's positions of every row
            cols = self.layers[0].cp_positions = sequence_positions(idx.shape[1], self.mesh.comm("cp"), self.cp_method)
            idx, targets = idx[:, cols], targets[:, cols]
        return idx, targets, len(idx)

    def eval_step(self, idx, targets):
        """The global batch's mean loss in eval mode, the forward alone through the mesh (gpt_3d_eval.py)."""
        from .gpt_3d_eval import eval_step
        return eval_step(self, idx, targets)

    def train_step(self, idx, targets):
        n = len(idx)
        self.masks.begin_step(n, idx.shape[1])
        idx, targets, _ = self.replica_batch(idx, targets)   # the pipeline weights each replica by its rows over n
        replicas = self.dp * self.cp if self.pre_divide else 1   # what backward's seed divides by already
        seed = self.loss_scale / replicas
        for layer in self.moe_layers:                             # the balancing loss's seed: as the loss's
            layer.reset_step()
            layer.main_loss_backward_scale = seed
        if self.zero is not None:
            self.zero.begin_step()                                # ZeRO-3: the stage's parameters gathered
        loss = self.pipe.train_step(idx, targets, self.model.loss, global_rows=n * self.cp, loss_scale=seed)
        self.masks.end_step()
        self.model.all_reduce_replicated_grads()                  # SP: the partial sums, once per step
        if self.ep > 1 and self.zero is None:                     # the experts: summed over expert-dp, / dp
            reduce_expert_gradients(self.local_experts, self.expert_dp_comm, self.dp * self.cp // replicas)
        if self.zero is not None:                                 # dp x cp mean, a shard each
            self.zero.reduce_gradients(self._unused_experts() if self.moe_layers else (),
                                       **({"op": "sum"} if self.pre_divide else {}))
        if self.dp * self.cp > 1:                                 # the replicas' mean: the global batch's
            loss = float(all_reduce(self.mesh.comm("dp_cp"), np.array([loss]), op="mean")[0])
        if self.moe_layers:        # (load_max_over_mean, tokens_dropped, aux_loss), gathered from every stage
            self.moe_statistics = moe_step_statistics(self.moe_layers, self.mesh.comm("pp"), self.mesh.comm("dp_cp"),
                                                      self.mesh.comm("tp") if self.model.sequence_parallel else None)
            loss += self.moe_statistics[2]
        return loss

    def _unused_experts(self):
        """ids of this rank's expert parameters that no token of the global batch chose this step (the loads
        summed over pp, dp and cp, and tp under sequence parallelism): one process leaves their grad None, and
        AdamW skips them."""
        loads = np.stack([layer.step_row()[:-2] for layer in self.moe_layers]).reshape(-1)
        loads = all_reduce(self.mesh.comm("dp_cp"), all_reduce(self.mesh.comm("pp"), loads, op="sum"), op="sum")
        if self.model.sequence_parallel:
            loads = all_reduce(self.mesh.comm("tp"), loads, op="sum")
        loads = loads.reshape(len(self.moe_layers), -1)
        first = [getattr(layer, "first_expert", 0) for layer in self.moe_layers]     # ep > 1: its own experts
        return {id(q) for layer, row, f in zip(self.moe_layers, loads, first) for l, expert in enumerate(layer.experts)
                if row[f + l] == 0 for q in expert.parameters()}

    def clip_grad_norm_(self, max_norm):
        """Clip by the norm of the whole model's gradient (shards summed over tp, stages over pp;
        the dp replicas hold the same averaged gradient, or with ZeRO each its shard: summed over dp); mixed
        precision's gradients, loss_scale times the true ones, by their norm over it (PyTorch's unscale_)."""
        scale = self.loss_scale
        if self.zero is not None:
            replicas = {id(q) for q in self.model.replicated} | {id(q) for q in self.model.wpe.parameters()}
            return self.zero.clip_grad_norm_(max_norm, [self.mesh.comm("tp"), self.mesh.comm("pp")],
                                             uncounted=replicas if self.mesh.coordinate("tp") else (), loss_scale=scale)
        if self.ep > 1 and self.zero is None:
            return ep_clip_grad_norm_(self.model, self.parameters(), self.local_experts, max_norm,
                                      self.mesh.comm("tp"), self.mesh.comm("pp"), self.ep_comm, loss_scale=scale)
        return self.model.clip_grad_norm_(max_norm, pipeline_comm=self.mesh.comm("pp"), loss_scale=scale)

    @property
    def local_experts(self):
        """With ep > 1: the expert parameters of this rank's stage (empty otherwise)."""
        local = {id(q) for q in self.pipe.parameters()}
        return [q for q in self.experts if id(q) in local]

    def full_state_dict(self):
        """name -> full array under the GPT's names (collectives over pp, then tp, on every rank)."""
        if self.zero is not None:
            self.zero.gather_parameters()                         # ZeRO-3: whole for the gather
        by_layer_name = self.pipe.full_state_dict()
        if self.zero is not None:
            self.zero.release_parameters()
        shards = {id(q): by_layer_name[name] for name, q in self.layers.named_parameters()}
        state = self.model.full_state_dict(shards)
        return gather_experts(state, self.ep_comm, self.model.config.moe_experts) if self.ep > 1 else state

    def sharded_parameters(self):
        """Where this rank's parameters sit in the GPT's logical tensors, for the checkpoint
        (gpt_3d_placements.py)."""
        from .gpt_3d_placements import sharded_parameters
        return sharded_parameters(self)

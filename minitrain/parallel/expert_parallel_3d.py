"""Expert parallelism inside GPT3D (dp x pp x tp, ep): Megatron-Core's expert-parallel group carved out of
the data-parallel ranks of one pipeline stage and one tensor-parallel coordinate (GShard, Lepikhin et al.
2021; Megatron-Core's MoE parallel folding keeps ep inside dp).

* The ep group: the mesh's dp communicator (the ranks with the same pp and tp coordinate) cut into blocks
  of ep consecutive replicas (expert_parallel_groups, as the data-parallel MoE job does), so an
  all-to-all never crosses a stage or a tensor-parallel coordinate. The ranks with the same position in
  their blocks hold the same experts: the expert data-parallel group, dp/ep of them.
* Tensor parallelism: the layer stays replicated on tp (tensor_parallel/moe.py). The t ranks of a stage
  see the same tokens, and each dispatches them over its own ep group: the same rows, the same split
  sizes, the same experts' outputs, so each expert's gradient is the same on every tp rank.
* Pipelines: each micro-batch's forward runs the layer's all-to-alls; the ranks of an ep group are on the
  same stage and run the same schedule, so their all-to-alls come in the same order. AllToAll has no
  weight: under the zero-bubble schedules its backward runs in B, with the input gradients.
* Gradients: the dense parameters are averaged over dp by the pipeline; the experts are left out of that
  all-reduce (PipelineParallel's dp_excluded) and summed over the expert data-parallel group, divided
  by dp (expert_data_parallel.reduce_expert_gradients). Clipping counts each expert once per tp group and
  the dense parameters on ep rank 0 only (clip_grad_norm_).
* Names: a layer keeps its experts under their global indices (h.3.mlp.experts.2.c_fc.weight on the rank
  that holds expert 2), so the shard map and the checkpoint place each expert where one process has it;
  gather_experts adds the other ranks' experts to a full state dict.
* ZeRO (ExpertZero): the dense parameters' Zero3D over dp, the experts' over the expert data-parallel
  group, their mean there times 1/ep (= the sum over dp / dp); each dp rank's two shards are distinct
  pieces of the gradient, so the global norm sums both over dp, tp and pp.
"""
import numpy as np

from ..backend import to_host
from ..comm import ring_all_gather
from ..nn.layers import ModuleList
from ..optim.mixed_precision import MixedPrecisionOptimizer
from .clip import clip_sharded_grad_norm_, sum_of_squares
from .expert_data_parallel import expert_parallel_groups
from .expert_parallel_moe import ExpertParallelMoE, expert_range
from .tensor_parallel.moe import ReplicatedMoE


class ExpertParallelReplicatedMoE(ExpertParallelMoE, ReplicatedMoE):
    """A ReplicatedMoE (its step figures, its aux loss seeded in backward) whose experts are sharded over
    ``comm``, the ep group: ExpertParallelMoE's dispatch, the experts named by their global index."""

    def __init__(self, moe, comm):
        ExpertParallelMoE.__init__(self, moe, comm)
        self.record_step = moe.record_step
        self.reset_step()
        experts = ModuleList()
        for e in expert_range(moe.num_experts, comm):
            setattr(experts, str(e), moe.experts[e])
        self.experts = experts


def shard_experts_3d(model, dp_comm, ep):
    """Every MoE layer of ``model`` (a TensorParallelGPT) made expert-parallel over blocks of ``ep`` ranks of
    ``dp_comm``. Returns (ep group, expert data-parallel group, the layers, their expert parameters)."""
    ep_comm, expert_dp_comm = expert_parallel_groups(dp_comm, ep)
    layers, before = [], {id(q) for q in model.parameters()}
    for block in model.h:
        if isinstance(block.mlp, ReplicatedMoE):
            block.mlp = ExpertParallelReplicatedMoE(block.mlp, ep_comm)
            layers.append(block.mlp)
    kept = {id(q) for q in model.parameters()}
    model.replicated = [q for q in model.replicated if id(q) in kept or id(q) not in before]   # others' experts freed
    if not layers:
        raise ValueError(f"expert parallelism: ep = {ep} but the GPT has no MoE layer")
    return ep_comm, expert_dp_comm, layers, [q for layer in layers for q in layer.experts.parameters()]


def expert_names(state):
    """The names in ``state`` that are an expert's: (name, layer prefix, global index, the rest)."""
    out = []
    for name in state:
        prefix, sep, rest = name.partition(".mlp.experts.")
        if sep:
            index, _, leaf = rest.partition(".")
            out.append((name, prefix, int(index), leaf))
    return out


def gather_experts(state, ep_comm, num_experts):
    """``state`` (name -> full array, this rank's experts only) with the experts of every rank of the ep
    group added (one all-gather over ``ep_comm``; a collective on every rank of it)."""
    per = num_experts // ep_comm.size
    mine = expert_names(state)
    if not mine:
        return state
    flat = np.concatenate([np.ascontiguousarray(to_host(state[name])).reshape(-1) for name, *_ in mine])
    every = ring_all_gather(ep_comm, flat, total=flat.size * ep_comm.size).reshape(ep_comm.size, -1)
    first = ep_comm.rank * per
    for rank in range(ep_comm.size):             # rank's experts are this rank's shifted by (rank - mine)·per
        at = 0
        for name, prefix, e, leaf in mine:
            shape = np.shape(state[name])
            size = int(np.prod(shape))
            state[f"{prefix}.mlp.experts.{e - first + rank * per}.{leaf}"] = every[rank, at:at + size].reshape(shape)
            at += size
    return state


def clip_grad_norm_(model, parameters, experts, max_norm, tp_comm, pp_comm, ep_comm, loss_scale=1.0):
    """Clip by the norm of the whole model's gradient: the squares of the dense parameters as
    TensorParallelGPT.clip_grad_norm_ counts them (a replicated one on tp rank 0), on ep rank 0 only (the ep
    ranks are dp replicas); the experts' on every ep rank (each holds others), on tp rank 0 (replicated on
    tp); summed over tp, pp and ep (the norm over ``loss_scale``: mixed precision's scaled gradients)."""
    replicated = {id(q) for q in model.replicated} | {id(q) for q in model.wpe.parameters()}
    expert_ids = {id(q) for q in experts}
    grads = [q for q in parameters if q.grad is not None]
    counted = [q.grad for q in grads if id(q) in expert_ids and tp_comm.rank == 0]
    if ep_comm.rank == 0:
        counted += [q.grad for q in grads if id(q) not in expert_ids and (id(q) not in replicated or tp_comm.rank == 0)]
    # a rank may count nothing (tp rank 1 of ep rank 1): its zero on the device the others' sums are on
    square = sum_of_squares(counted, like=grads[0].grad if grads else None)
    return clip_sharded_grad_norm_(grads, max_norm, square, [tp_comm, pp_comm, ep_comm], loss_scale)


class ExpertZero:
    """Zero3D's interface over two: ``dense`` (a Zero3D over dp) and ``experts`` (a Zero3D over the expert
    data-parallel group, per_parameter; None on a stage without experts)."""

    def __init__(self, dense, experts, ep):
        self.dense, self.experts, self.ep = dense, experts, ep
        self.stage, self.comm = dense.stage, dense.comm
        self.parts = [z for z in (dense, experts) if z is not None]

    def optimizer(self, optimizer_class, **defaults):
        for z in self.parts:
            z.optimizer(optimizer_class, **defaults)
        # the dense's groups are the ones a scheduler sets and a checkpoint keeps, as many as one process's
        # optimizer has (a scheduler's per-group lists, base_lrs, then fit any layout); step() hands their
        # hyper-parameters to the experts' groups
        self.param_groups = self.dense.param_groups
        return self

    def step(self):
        for dense, experts in zip(self.dense.param_groups, self.experts.param_groups if self.experts else ()):
            experts.update({k: v for k, v in dense.items() if k != "params"})
        verdict = {}
        first, *others = self.inners
        if isinstance(first, MixedPrecisionOptimizer):             # both parts skip alike: one loss scale
            verdict["found_inf"] = first.found_inf(also=others)
        for z in self.parts:
            z.step(**verdict)

    @property
    def inners(self):
        """The parts' own optimizers, the dense shard's first."""
        return [z.inner for z in self.parts]

    def reduce_gradients(self, unused=(), op="mean"):
        """The dense part's mean over dp x cp; the experts' over their expert data-parallel group, / ep: the
        same mean (op "sum": each replica's gradient already divided by dp x cp, as mixed precision's are)."""
        self.dense.reduce_gradients(unused, op=op)
        if self.experts is not None:
            self.experts.reduce_gradients(unused, **({"op": "sum"} if op == "sum" else {"scale": 1.0 / self.ep}))

    def clip_grad_norm_(self, max_norm, groups, uncounted=(), loss_scale=1.0):
        square = sum(z.local_square(uncounted) for z in self.parts)
        return clip_sharded_grad_norm_([z.shard for z in self.parts], max_norm, square, [self.comm, *groups],
                                       loss_scale)

    def expected_bytes(self, optimizer_states=2):
        parts = [z.expected_bytes(optimizer_states) for z in self.parts]
        return {key: sum(p[key] for p in parts) for key in parts[0]}

    def state_dict(self):
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict() if self.experts else None}

    def load_state_dict(self, state_dict):
        self.dense.load_state_dict(state_dict["dense"])
        if self.experts is not None:
            self.experts.load_state_dict(state_dict["experts"])

    # ---- checkpoints: one optimizer's logical tensors and scalars, whatever layout reads them back
    def shard_placements(self, placements):
        """Stage 3's parameters: each part's shard, cut across the logical tensors (Zero3D's)."""
        return [(z.shard, z.shard_placements(placements)) for z in self.parts]

    def sharded_state_dict(self, placements):
        """The two optimizers' states as one's: their tensors (the experts' names and the dense ones differ),
        the dense's hyper-parameters (a scheduler sets both alike) and both's per-parameter counters."""
        (tensors, scalars), *more = [z.sharded_state_dict(placements) for z in self.parts]
        for other_tensors, other in more:
            tensors = {**tensors, **other_tensors}
            scalars = {**scalars, "param_state": {**scalars["param_state"], **other["param_state"]}}
        return tensors, scalars

    def load_sharded_state_dict(self, reader, placements, scalars):
        for z in self.parts:                 # each reads its own parameters' pieces and counters
            z.load_sharded_state_dict(reader, placements, scalars)

    def _each(name):
        def call(self):
            for z in self.parts:
                getattr(z, name)()
        call.__name__ = name
        return call

    begin_step, zero_grad = _each("begin_step"), _each("zero_grad")
    gather_parameters, release_parameters = _each("gather_parameters"), _each("release_parameters")

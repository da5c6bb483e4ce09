"""Data parallelism around expert parallelism (GShard, Lepikhin et al. 2021; Megatron-Core's expert
data-parallel group): which ranks average which gradients, and by how much.

The ep ranks of an expert-parallel group are ep consecutive data-parallel ranks (Megatron-Core carves
the expert-parallel group out of the data-parallel one): dp/ep groups, each holding every expert once.
The ranks with the same coordinate in their groups hold the same experts: the expert data-parallel
group, dp/ep of them.

Each of the dp ranks computes the loss of its own rows, L_r, and the step follows the gradient of the
global batch's loss (1/dp) sum_r L_r, as one process on the global batch does:

* a dense parameter (router, attention, embeddings) is on every rank, which computes dL_r/dw: the
  gradient is the mean over all dp ranks (DistributedDataParallel over the data-parallel group);
* an expert on rank r of group g received the rows of every rank of g, so its backward already
  summed sum_{s in g} dL_s/dw over the ep ranks of the group. Summing that over the dp/ep groups
  (the expert data-parallel group) gives sum over all dp ranks, and the gradient is that sum / dp:
  the mean over the expert data-parallel group divided by ep once more, not the mean alone.

An expert no rank of the run used keeps grad None, as in one process (an idle expert gets no weight
decay step either). Clipping takes the norm of the whole gradient: the dense part counted once per
expert-parallel group (on its first rank), each expert on the rank that holds it (parallel/clip.py).
"""
import numpy as np

from ..backend import array_module
from ..comm import all_reduce
from .clip import clip_sharded_grad_norm_, sum_of_squares
from .data_parallel import DistributedDataParallel
from .expert_parallel_moe import ExpertParallelMoE


def expert_parallel_groups(comm, ep):
    """(expert-parallel group, expert data-parallel group) of this rank: blocks of ep consecutive ranks,
    and the ranks with the same position in their blocks."""
    if ep < 1 or comm.size % ep:
        raise ValueError(f"expert parallelism: ep={ep} must divide the {comm.size} data-parallel ranks")
    return comm.split(comm.rank // ep), comm.split(comm.rank % ep)


class _Parameters:
    """What DistributedDataParallel reads of a module: its parameters (here the dense ones only)."""

    def __init__(self, params):
        self.params = params

    def parameters(self):
        return iter(self.params)


class ExpertDataParallel:
    """``model`` (its MoE layers already ExpertParallelMoE over ``ep_comm``) trained by the dp ranks of
    ``comm``: dense gradients averaged by DDP during backward, the experts' by reduce_expert_gradients().
    ``pre_divided``: backward's seed already divides by dp (16-bit gradients), so both are summed instead."""

    def __init__(self, model, comm, ep_comm, expert_dp_comm, pre_divided=False):
        self.model, self.comm, self.ep_comm, self.expert_dp_comm = model, comm, ep_comm, expert_dp_comm
        self.divisor = 1 if pre_divided else comm.size
        expert_ids = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE)
                      for p in m.experts.parameters()}
        self.experts = [p for p in model.parameters() if id(p) in expert_ids]
        self.dense = [p for p in model.parameters() if id(p) not in expert_ids]
        self.ddp = DistributedDataParallel(_Parameters(self.dense), comm, find_unused_parameters=True,
                                           reduce_op="sum" if pre_divided else "mean")

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def reduce_expert_gradients(self):
        """After backward: every expert's gradient summed over the expert data-parallel group and divided
        by dp (see the module's docstring; by 1 when pre-divided)."""
        reduce_expert_gradients(self.experts, self.expert_dp_comm, self.divisor)

    def clip_grad_norm_(self, max_norm, loss_scale=1.0):
        """Clip by the norm of the global gradient (over ``loss_scale``: mixed precision's scaled gradients);
        returns it."""
        counted = [p.grad for p in self.experts if p.grad is not None]
        if self.ep_comm.rank == 0:
            counted += [p.grad for p in self.dense if p.grad is not None]
        return clip_sharded_grad_norm_(self.model.parameters(), max_norm, sum_of_squares(counted), [self.ep_comm],
                                       loss_scale)


def reduce_expert_gradients(experts, expert_dp_comm, dp):
    """Each expert parameter's gradient summed over ``expert_dp_comm`` and divided by ``dp`` (the data-parallel
    ranks, ep times expert_dp_comm's size); one flag per parameter says whether any rank used it (else grad None)."""
    if not experts:
        return
    xp = array_module(experts[0].data)
    grads = [xp.zeros(p.shape, p.dtype) if p.grad is None else p.grad for p in experts]
    used = np.array([p.grad is not None for p in experts], np.float64)
    flat = all_reduce(expert_dp_comm, xp.concatenate([g.reshape(-1) for g in grads]), op="sum")
    used = all_reduce(expert_dp_comm, used, op="sum")
    at = 0
    for p, u in zip(experts, used):
        part = flat[at:at + p.size].reshape(p.shape) / dp
        at += p.size
        p.grad = part if u else None

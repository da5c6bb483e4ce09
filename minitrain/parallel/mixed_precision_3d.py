"""Mixed precision on the GPT's 3D mesh (Micikevicius et al. 2018; Megatron-LM's Float16OptimizerWithFloat16Params
and its distributed optimizer): the parameters, gradients and activations in float16 / bfloat16, each rank's
optimizer keeping fp32 master weights and AdamW's moments of what it steps (its parameters, or with ZeRO its
shard), fp16 scaling its loss (optim/mixed_precision.py).

What the mesh adds: the ranks hold different parameters (tp shards, pp stages, ep experts, ZeRO shards over
dp), so an inf in one rank's gradient is seen by that rank alone, yet a step taken by some ranks and skipped
by others would leave a model no process could train. The found-inf flag is the maximum over every rank of
the mesh (the world communicator, as Megatron's over its model-parallel group and data-parallel ranks): one
all-reduce of one number per step. The loss scale then moves alike everywhere; GPT3D seeds each
micro-batch's backward with it (the pipeline's loss_scale; the MoE layers' balancing losses, seeded by
AuxLossAutoScaler, with it too) divided by the dp x cp replicas, whose gradients are then summed, not averaged
(PyTorch DDP's pre-division, Megatron's: no partial sum of 16-bit gradients exceeds the global one, which a
mean summed first would by dp x cp), and clips by the gradient's norm over the scale.
Bytes per parameter a rank steps: 2 (param) + 2 (grad) + 4 (master) + 8 (AdamW's moments).
"""
import functools

from ..backend import LOW_PRECISION
from ..optim.mixed_precision import MixedPrecisionOptimizer
from .expert_parallel_3d import ExpertZero
from .offload import found_inf_on_any_rank


def is_mixed(params):
    """Whether the parameters are float16 / bfloat16 (mixed precision's)."""
    return bool(params) and params[0].dtype in LOW_PRECISION


def mixed_precision_optimizer(model, optimizer_class, init_scale=2.0 ** 16, **defaults):
    """(the optimizer the job steps, the MixedPrecisionOptimizer inside it that holds the loss scale) for
    GPT3D ``model`` with 16-bit parameters: optimizer_class on fp32 masters of its parameters, or with ZeRO
    of its shard, every rank of ``model.comm`` agreeing on the steps to skip."""
    agree = found_inf_on_any_rank(model.comm)                 # the whole mesh: every rank skips alike
    if model.zero is None:
        opt = MixedPrecisionOptimizer(model.parameters(), optimizer_class, all_reduce_found_inf=agree,
                                      init_scale=init_scale, **defaults)
        return opt, opt
    zero = model.zero.optimizer(functools.partial(MixedPrecisionOptimizer, optimizer_class=optimizer_class,
                                                  all_reduce_found_inf=agree, init_scale=init_scale), **defaults)
    if isinstance(zero, ExpertZero):     # ep > 1: a dense and an experts' optimizer, stepped on one verdict
        return zero, SharedLossScale(zero.inners)
    return zero, zero.inner


class SharedLossScale:
    """The one loss scale of MixedPrecisionOptimizers that skip the same steps (ExpertZero's dense shard's
    and experts' shard's): their scales move alike; read from the first, reset on every one."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    @property
    def loss_scale(self):
        return self.optimizers[0].loss_scale

    @property
    def skipped_steps(self):
        return self.optimizers[0].skipped_steps

    def reset_loss_scale(self, scale):
        for opt in self.optimizers:
            opt.reset_loss_scale(scale)

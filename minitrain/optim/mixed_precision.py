"""Mixed-precision training (Micikevicius et al. 2018, "Mixed Precision Training"): the model
computes in float16 or bfloat16, the optimizer keeps fp32 master weights and its state in fp32.

    model.to(np.float16)                                     # parameters and gradients: 2 bytes
    opt = MixedPrecisionOptimizer(model.parameters(), optim.Adam, lr=1e-3)   # fp16: dynamic loss scale
    loss = F.cross_entropy(model(x.to(np.float16)).float(), y)
    opt.scale(loss).backward()
    opt.step()                    # unscale, skip on inf/NaN, step the fp32 masters, copy them back

Bytes per parameter: 2 (param) + 2 (grad) + K with K = 4 (master) + 4 + 4 (Adam's moments) = 12,
the (2 + 2 + K)Ψ of the ZeRO paper. The masters count as optimizer_state.

On the GPU the inf/NaN check is one device reduction over all gradients and one synchronisation
per step (skipping a step is a decision the host makes, as in PyTorch's GradScaler).

Loss scaling (fp16 only; bfloat16 has fp32's exponent range): small gradients underflow in fp16,
so the loss is multiplied by S before backward and the gradients divided by S in fp32 after. With
loss_scale="dynamic" (PyTorch's GradScaler defaults) S starts at 2**16, halves and skips the
step when any gradient is inf/NaN, and doubles after growth_interval clean steps. When the
parameters are shards (ZeRO, FSDP) every rank must skip the same steps: pass
all_reduce_found_inf, a function that takes this rank's flag (a one-element float array, 1.0 for
inf/NaN) and returns its maximum over the ranks, e.g. lambda flag: all_reduce(comm, flag, op="max").
The optimizer receives the reduction and imports no communication (optim sits below comm's users).
"""
import contextlib
import math
import weakref

import numpy as np

from .. import backend, kernels, memory
from ..autograd import Tensor
from ..backend import LOW_PRECISION, array_module
from .clip import clip_grad_norm_, sum_of_squares
from .optimizer import _release, param_groups


def check_scaling(loss_scale, init_scale, growth_factor, backoff_factor, growth_interval):
    """What GradScaler asserts (growth above 1, backoff below 1), and what would silently stop training: a scale of
    0 zeroes every gradient (and 0 as a static loss_scale read as none), inf or NaN makes every step overflow."""
    def positive_finite(x):
        return backend.is_real(x) and 0 < x < math.inf
    problems = []
    if loss_scale not in ("auto", "dynamic", None) and not positive_finite(loss_scale):
        problems.append(f"loss_scale must be 'auto', 'dynamic', None or a positive finite number, got {loss_scale!r}")
    if not positive_finite(init_scale):
        problems.append(f"init_scale must be a positive finite number, got {init_scale!r}")
    if not (backend.is_real(growth_factor) and growth_factor > 1):
        problems.append(f"growth_factor must be > 1, got {growth_factor!r}")
    if not (backend.is_real(backoff_factor) and 0 < backoff_factor < 1):
        problems.append(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if not (backend.is_int(growth_interval) and growth_interval >= 1):
        problems.append(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
    if problems:
        raise ValueError("MixedPrecisionOptimizer: " + "; ".join(problems))


class MixedPrecisionOptimizer:
    #: where the masters and the optimizer state live (CPUOffloadOptimizer: the host)
    offload = False

    def __init__(self, params, optimizer_class, loss_scale="auto", all_reduce_found_inf=None, init_scale=2.0 ** 16,
                 growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, **defaults):
        groups = [{**g, "params": [q for q in g["params"] if q.requires_grad]}       # PyTorch's groups too
                  for g in param_groups(params, "MixedPrecisionOptimizer")]
        self.params = [q for g in groups for q in g["params"]]
        if not self.params:
            raise ValueError("MixedPrecisionOptimizer: no parameter requires grad")
        dtypes = {q.dtype for q in self.params}
        if len(dtypes) != 1 or (next(iter(dtypes)) not in LOW_PRECISION and not self.offload):
            raise TypeError(f"MixedPrecisionOptimizer expects float16 or bfloat16 parameters, got "
                            f"{sorted(map(str, dtypes))} (cast the model with model.to(dtype) first)")
        self.dtype = next(iter(dtypes))
        check_scaling(loss_scale, init_scale, growth_factor, backoff_factor, growth_interval)
        if loss_scale == "auto":                     # fp16 needs it, bf16 does not
            loss_scale = "dynamic" if self.dtype == np.float16 else None
        self.dynamic = loss_scale == "dynamic"
        self.loss_scale = float(init_scale if self.dynamic else (loss_scale or 1.0))
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.all_reduce_found_inf = all_reduce_found_inf
        self._good_steps = 0
        self.skipped_steps = 0
        self._tracker = memory.tracker()
        self.masters = []
        with self._placement():
            for q in self.params:                    # fp32 copies the optimizer updates
                # (offloading fp32/fp64 parameters keeps their dtype: the master is a host copy)
                dtype = np.float32 if q.dtype in LOW_PRECISION else q.dtype
                master = Tensor(backend.to_host(q.data) if self.offload else q.data, requires_grad=True)
                master.data = master.data.astype(dtype)            # always a copy
                self._tracker.add("optimizer_state", ("master", id(self), id(master)), master.data.nbytes)
                self.masters.append(master)
            # the masters' bytes leave the tracker with this optimizer (as Optimizer's state does)
            weakref.finalize(self, _release, self._tracker, [("master", id(self), id(m)) for m in self.masters])
            master_of = {id(q): m for q, m in zip(self.params, self.masters)}
            self.optimizer = optimizer_class([{**g, "params": [master_of[id(q)] for q in g["params"]]} for g in groups],
                                             **defaults)
        self.param_groups = self.optimizer.param_groups

    def _placement(self):
        return memory.on_host() if self.offload else contextlib.nullcontext()

    def scale(self, loss):
        """The loss times the current scale: call ``.backward()`` on this."""
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def clip_grad_norm_(self, max_norm):
        """Clip by the norm of the true gradient: the gradients are the loss scale S times too large,
        so the norm is theirs over S (squares summed in float64: S·g overflows in fp16 when squared).
        optim.clip_grad_norm_ on the parameters would clip by S times the norm (PyTorch: the
        GradScaler's unscale_ first). Returns the norm. For whole parameters (one process, DDP's
        replicas); shards (all_reduce_found_inf given) clip with their strategy's method."""
        if self.all_reduce_found_inf is not None:
            raise ValueError("MixedPrecisionOptimizer.clip_grad_norm_ sees this rank's parameters only, and these are "
                             "shards (all_reduce_found_inf was given): clip with the strategy's clip_grad_norm_ "
                             "(FSDP: fsdp.clip_grad_norm_(max_norm, loss_scale=opt.loss_scale))")
        params = [q for q in self.params if q.grad is not None]
        square = sum_of_squares(q.grad for q in params)
        total = (array_module(square).sqrt(square[0]) if backend.is_device_array(square)
                 else math.sqrt(float(square[0]))) / self.loss_scale
        return clip_grad_norm_(params, max_norm, total_norm=total)

    def found_inf(self, also=()):
        """Whether this step's gradients hold an inf/NaN: this optimizer's and those of the optimizers in
        ``also`` that step beside it (the experts' shards beside the dense ones: one verdict, one scale)."""
        grads = [q.grad for o in (self, *also) for q in o.params if q.grad is not None]
        if grads and backend.is_device_array(grads[0]):     # one device reduction, one synchronisation
            counts = array_module(grads[0]).stack([kernels.count_nonfinite(g) for g in grads])
            local = bool(backend.to_scalar(counts.sum()))
        else:
            local = any(not bool(array_module(g).isfinite(g).all()) for g in grads)
        if self.all_reduce_found_inf is None:
            return local
        # shards: every rank must agree to skip (the maximum of the ranks' flags)
        return bool(self.all_reduce_found_inf(np.array([float(local)]))[0])

    def step(self, found_inf=None):
        """Unscale the gradients into fp32, step the masters, copy them into the parameters.
        Returns False (and lowers the scale) when the step was skipped for inf/NaN gradients
        (``found_inf``: the verdict, where found_inf(also=...) gave it for several optimizers)."""
        if self.found_inf() if found_inf is None else found_inf:
            self.skipped_steps += 1
            self._good_steps = 0
            if self.dynamic:
                self.loss_scale *= self.backoff_factor
            return False
        grad_bytes = 0
        for q, master in zip(self.params, self.masters):
            if q.grad is None:
                master.grad = None
                continue
            # offload: this is the device -> host copy of the gradient (on CuPy a real transfer)
            master.grad = (backend.to_host(q.grad) if self.offload else q.grad).astype(master.dtype)
            if self.loss_scale != 1.0:
                master.grad *= 1.0 / self.loss_scale
            grad_bytes += master.grad.nbytes
        with self._placement():
            self._tracker.add("grads", ("fp32 grads", id(self)), grad_bytes)   # live during the step only
            self.optimizer.step()
        for q, master in zip(self.params, self.masters):
            master.grad = None
            # round to the parameters' precision in place (offload: the host -> device copy)
            q.data[...] = backend.to_device(master.data) if backend.is_device_array(q.data) else master.data
        self._tracker.remove(("fp32 grads", id(self)))
        self._good_steps += 1
        if self.dynamic and self._good_steps % self.growth_interval == 0:
            self.loss_scale *= self.growth_factor
        return True

    def reset_loss_scale(self, scale):
        """The loss scale starts again from ``scale``, as a fresh run's (its count of good steps too)."""
        self.loss_scale, self._good_steps = float(scale), 0

    def zero_grad(self, set_to_none=True):
        for q in self.params:
            if set_to_none:
                q.grad = None
            elif q.grad is not None:
                q.grad[...] = 0

    def add_param_group(self, param_group):
        """Refused, where PyTorch's optimizers take a group later: the fp32 master weights are made once,
        in the constructor."""
        raise NotImplementedError(f"{type(self).__name__}.add_param_group: the fp32 master weights are made "
                                  "once, in the constructor: pass every parameter group to it")

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "loss_scale": self.loss_scale,
                "masters": [m.data.copy() for m in self.masters], "good_steps": self._good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict):
        """The inverse of ``state_dict()`` (same parameters, same layout)."""
        if len(state_dict["masters"]) != len(self.masters):
            raise ValueError(f"load_state_dict: {len(state_dict['masters'])} master weights for {len(self.masters)} parameters")
        for master, saved in zip(self.masters, state_dict["masters"]):
            if tuple(saved.shape) != master.shape:
                raise ValueError(f"load_state_dict: a master weight of shape {tuple(saved.shape)}, expected {master.shape}")
            master.data[...] = backend.to_device(saved, "cuda") if backend.is_device_array(master.data) else saved
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.loss_scale = float(state_dict["loss_scale"])
        self._good_steps = int(state_dict.get("good_steps", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    # ---- the checkpoint's view (minitrain.sharded): masters and moments cut as the parameters are
    def _master_placements(self, placements):
        return {id(m): placements[id(q)] for q, m in zip(self.params, self.masters)}

    def sharded_state_dict(self, placements):
        """The inner optimizer's state on the masters, plus ``<name>/master`` when the masters are of
        another dtype than the parameters (fp16/bf16: fp32 masters; an fp32 master equals its
        parameter, so it is not stored twice), plus the loss scale and its counters."""
        tensors, scalars = self.optimizer.sharded_state_dict(self._master_placements(placements))
        for q, master in zip(self.params, self.masters):
            if master.dtype != q.dtype:
                for name, piece in placements[id(q)]:
                    tensors.setdefault(f"{name}/master", []).append((piece, piece.view(master.data)))
        scalars["mixed_precision"] = {"loss_scale": self.loss_scale, "good_steps": self._good_steps,
                                      "skipped_steps": self.skipped_steps}
        return tensors, scalars

    def load_sharded_state_dict(self, reader, placements, scalars):
        """Masters (or, when they share the parameters' dtype, copies of the just-loaded parameters),
        the inner optimizer's state, and the loss scale (a checkpoint without one: unscaled, as fp32)."""
        for q, master in zip(self.params, self.masters):
            if master.dtype != q.dtype:
                for name, piece in placements[id(q)]:
                    reader.read_into(f"{name}/master", piece, piece.view(master.data))
            else:
                master.data[...] = backend.to_host(q.data) if self.offload else q.data
        self.optimizer.load_sharded_state_dict(reader, self._master_placements(placements), scalars)
        saved = scalars.get("mixed_precision")
        if saved is None and self.dtype == np.float16:
            raise ValueError("the checkpoint has no loss scale: it was not trained in float16 mixed precision")
        if saved is not None:
            self.loss_scale = float(saved["loss_scale"])
            self._good_steps, self.skipped_steps = int(saved["good_steps"]), int(saved["skipped_steps"])

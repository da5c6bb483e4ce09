"""ZeRO stage 3 as FullyShardedDataParallel (Rajbhandari et al. 2020 sec. 5.3; Zhao et al. 2023,
"PyTorch FSDP"): the parameters themselves are sharded at rest.

The model is cut into units (by default every layer of every Sequential / ModuleList, plus a root
unit for the rest). Each unit's parameters live as one flat padded buffer of which each rank keeps
only its 1/p shard: that shard is the Parameter the optimizer sees. Around a unit's forward:

* before: all-gather the shards into the full buffer and point the parameters at views of it;
* after: free the full buffer (the parameters keep their shape through a zero-stride placeholder).
  Autograd saved views of the weights for backward (a Linear keeps its weight): a saved-tensor
  hook replaces each such view by a small reference, and unpacking it in backward **gathers the
  unit again**, just before that unit's backward needs it;
* in backward, once every gradient of the unit is final, they are reduce-scattered (average) into
  the shard's gradient, the full gradients are dropped and the unit is freed again.

Bytes per step: all-gather in forward + all-gather in backward + reduce-scatter = 3(p-1)/p·Ψ·b.
Model states per rank: (4 + 4 + K)Ψ/N, 16Ψ/N for fp32 Adam, up to padding; the peak adds the
largest gathered unit or two and their gradients. Tied weights must live in one unit.
"""
import contextlib

from .. import backend, memory
from ..autograd.engine import in_backward, queue_callback
from ..autograd.graph import current_saved_tensors_hooks, saved_tensors_hooks
from ..comm import broadcast, ring_all_gather, ring_reduce_scatter
from ..nn import Module, ModuleList, Parameter, Sequential
from . import accounting
from .clip import clip_sharded_grad_norm_, sum_of_squares
from .data_parallel import check_reduce_op
from .flat_buffer import FlatParamBuffer
from .fsdp_state import FSDPStateDicts


class _UnitRef:
    """What a saved view of a unit's full buffer becomes while the unit is freed."""

    __slots__ = ("unit", "offset", "shape", "strides")

    def __init__(self, unit, offset, shape, strides):
        self.unit, self.offset, self.shape, self.strides = unit, offset, shape, strides


@accounting.fsdp_unit            # its staging buffer in the memory ledger, its gathers traced: accounting.py
class _Unit:
    """One unit (Zhao et al. 2023, sec. 3.2): its parameters in one flat buffer, sharded at rest;
    gathered for its forward and its backward, freed after each, its gradients reduce-scattered."""

    def __init__(self, name, module, params, comm, offload_params=False, reduce_op="mean"):
        self.name, self.module, self.comm, self.reduce_op = name, module, comm, reduce_op
        self.offload_params = offload_params
        self.params = params
        self.trainable = [q for q in params if q.requires_grad]
        # the unit's flat padded buffer: whole (flat.data) only while gathered, else None
        self.flat = FlatParamBuffer(params, comm.size, comm.rank, who=f"FullyShardedDataParallel unit {name}")
        self.xp, self.dtype = self.flat.xp, self.flat.dtype
        broadcast(comm, self.flat.data, root=0)            # every rank starts from rank 0's weights
        with memory.on_host() if offload_params else contextlib.nullcontext():   # offload: shards on the host
            self.shard = Parameter(backend.to_host(self.flat.shard()).copy(), requires_grad=bool(self.trainable))
        self.gathering = self.gather_work = None       # a prefetch in flight
        self._placeholder = self.xp.zeros((), self.dtype)
        self.release()
        self.ready = set()
        self.reduced = False                            # this backward's reduce-scatter has started
        self.staging = None
        self.work = None

    # ---- gather / release
    def prefetch(self):
        """Start the all-gather without waiting for it (``gather()`` later waits)."""
        if self.flat.data is None and self.gathering is None:
            self.gathering = self.xp.empty(self.flat.padded, self.dtype)
            # offload: the shard is copied host -> device first (on CuPy a real transfer)
            source = backend.to_device(self.shard.data) if self.offload_params else self.shard.data
            self.gather_work = ring_all_gather(self.comm, source, total=self.flat.padded,
                                               out=self.gathering, async_op=True)

    def gather(self):
        if self.flat.data is None:
            self._wait_for_gather()
            self.flat.point_params_at()

    def _wait_for_gather(self):
        self.prefetch()
        self.gather_work.wait()
        self.flat.data, self.gathering, self.gather_work = self.gathering, None, None

    def release(self):
        if self.gather_work is not None:              # a prefetch nobody used: finish it first
            self.gather_work.wait()
            self.gathering = self.gather_work = None
        for q in self.params:
            q.data = self.xp.broadcast_to(self._placeholder, q.shape)   # the shape, no memory
        self.flat.data = None

    def view(self, ref):
        self.gather()
        return backend.view_of(self.flat.data, ref.shape, self.dtype, ref.offset, ref.strides)

    # ---- gradients
    def staging_buffer(self):
        """The full gradient buffer the reduce-scatter reads (made at the unit's first gradient)."""
        if self.staging is None:
            self.staging = self.flat.new()
        return self.staging

    def grad_ready(self, q):
        self.flat.view(q, self.staging_buffer())[...] = q.grad
        q.grad = None                                  # the full gradient is not kept
        self.ready.add(id(q))
        if len(self.ready) == len(self.trainable):
            self.reduce()

    def reduce(self):
        staging = self.staging_buffer()               # zeros if no gradient reached this unit
        self.grad_out = self.xp.zeros(self.flat.shard_size, self.dtype)
        self.work = ring_reduce_scatter(self.comm, staging, op=self.reduce_op, out=self.grad_out, async_op=True)
        self.reduced = True
        self.release()

    def finish(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
            # the shard's gradient (offload: copied device -> host); a second backward before
            # zero_grad adds to it (gradient accumulation, as in PyTorch)
            grad = backend.to_host(self.grad_out) if self.offload_params else self.grad_out
            if self.shard.grad is None:
                self.shard.grad = grad
            else:
                self.shard.grad += grad
            self.grad_out = None
        self.staging = None
        self.ready.clear()


def default_units(module):
    """Every module that is an element of a Sequential or ModuleList and holds parameters."""
    units = []
    for name, m in module.named_modules():
        if isinstance(m, (Sequential, ModuleList)):
            for child_name, child in m.named_children():
                if any(True for _ in child.parameters()):
                    units.append((f"{name}.{child_name}" if name else child_name, child))
    return units


def check_units(units, root, names, owner):
    """Tied weights in one unit; each unit frozen or trainable whole (its shard is stepped whole)."""
    for unit in units:
        frozen = [names[id(q)] for q in unit.params if not q.requires_grad]
        if frozen and unit.trainable:
            raise ValueError(f"FullyShardedDataParallel: unit {unit.name} mixes frozen parameters ({', '.join(frozen)})"
                             f" with trainable ones; freeze whole units or choose units (auto_wrap) that part them")
        for q in unit.module.parameters() if unit.module is not root else ():
            if owner.get(id(q)) != unit.name:
                raise ValueError(f"FullyShardedDataParallel: parameter {names[id(q)]} is shared by "
                                 f"units {owner.get(id(q))} and {unit.name}; tied weights must live in one unit")


@accounting.fsdp                 # the wait for its reduce-scatters is a trace span: see accounting.py
class FullyShardedDataParallel(FSDPStateDicts):
    """``FullyShardedDataParallel(model, comm)``: shard every unit's parameters over ``comm``.
    ``parameters()`` yields the local shards (give them to any optimizer); the state dicts (the full
    parameters under the unwrapped model's names) are in fsdp_state.py. ``auto_wrap(module) -> list
    of (name, submodule)`` chooses the units (default: the layers of every Sequential / ModuleList).
    ``prefetch``: start the next unit's all-gather while this one computes (forward and backward).
    ``offload_params``: the shards and their gradients live on the host (pair it with
    CPUOffloadOptimizer so that the optimizer state does too); the device holds gathered units only.
    ``reduce_op="sum"`` where backward's seed divides by the replicas (16-bit gradients), as in DDP. Several
    backward calls before the optimizer step add their gradients up, until ``zero_grad`` (PyTorch's semantics)."""

    def __init__(self, module, comm, auto_wrap=None, prefetch=True, offload_params=False, reduce_op="mean"):
        if not isinstance(module, Module):
            raise TypeError("FullyShardedDataParallel wraps an nn.Module")
        reduce_op = check_reduce_op(reduce_op, "FullyShardedDataParallel")
        self.module, self.comm, self.prefetch = module, comm, prefetch
        self.names = names = {id(q): n for n, q in module.named_parameters()}
        owner, self.units = {}, []
        for name, sub in (auto_wrap or default_units)(module):
            params = [q for q in sub.parameters() if id(q) not in owner]
            if params:
                for q in params:
                    owner[id(q)] = name
                self.units.append(_Unit(name, sub, params, comm, offload_params, reduce_op))
        rest = [q for q in module.parameters() if id(q) not in owner]
        if rest:
            self.units.append(_Unit("root", module, rest, comm, offload_params, reduce_op))
        check_units(self.units, module, names, owner)
        self._pending = False
        layers = [u for u in self.units if u.module is not module]     # in forward order
        for i, unit in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            unit.module.register_forward_pre_hook(lambda m, args, u=unit, n=nxt: self._before_forward(u, n))
        for unit in self.units:
            if unit.module is not module:
                unit.module.register_forward_hook(lambda m, args, out, u=unit: self._after_forward(u))
            for q in unit.trainable:
                q.register_post_accumulate_grad_hook(lambda q, u=unit: self._grad_ready(q, u))
        self._root = next((u for u in self.units if u.module is module), None)

    def _before_forward(self, unit, next_unit):
        unit.gather()
        # its all-gather overlaps this unit's forward; not in a recomputation inside backward, where the
        # next unit in forward order has had its backward already (PyTorch's FSDP prefetches there neither)
        if self.prefetch and next_unit is not None and not in_backward():
            next_unit.prefetch()

    def _after_forward(self, unit):
        # a recomputation inside backward saved views of the gathered unit (these hooks are not on there): it
        # stays gathered, as the ledger then sees, until its gradients are reduce-scattered
        if not in_backward():
            unit.release()

    # ---- forward: saved views of gathered units become references
    def _unit_holding(self, array):
        """The unit whose gathered buffer ``array`` is a view of, or None."""
        if not hasattr(array, "base"):
            return None
        base = memory.owner(array)
        for unit in self.units:
            if unit.flat.data is not None and unit.flat.data is base:
                return unit
        return None

    def _pack(self, a, outer=None):
        unit = self._unit_holding(a)
        if unit is None:              # an activation: the enclosing hooks' (offload_activations), if any
            return outer[0](a) if outer else a
        return _UnitRef(unit, backend.byte_offset(a, unit.flat.data), a.shape, a.strides)

    def _unpack(self, x, outer=None):
        if not isinstance(x, _UnitRef):
            return outer[1](x) if outer else x
        if self.prefetch and x.unit.flat.data is None:
            # backward runs the units in reverse: fetch the one before while this one computes
            i = self.units.index(x.unit)
            if i > 0 and self.units[i - 1].module is not self.module:
                x.unit.gather()
                self.units[i - 1].prefetch()
        return x.unit.view(x)

    def __call__(self, *args, **kwargs):
        if self._root is not None:
            self._root.gather()
        outer = current_saved_tensors_hooks()        # only the innermost hooks run: these pass the rest on
        with saved_tensors_hooks(lambda a: self._pack(a, outer), lambda x: self._unpack(x, outer)):
            out = self.module(*args, **kwargs)
        if self._root is not None:
            self._root.release()
        return out

    # ---- backward
    def _grad_ready(self, q, unit):
        if not self._pending:
            self._pending = True
            queue_callback(self._finish_backward)
        unit.grad_ready(q)
        if unit.work is not None:
            # at most two reduce-scatters in flight: an earlier unit's staging buffer is freed
            # as soon as this one starts, so comm buffers stay near two units, not the model
            for other in self.units:
                if other is not unit and other.work is not None:
                    other.finish()

    def _finish_backward(self):
        for unit in self.units:
            if unit.trainable and not unit.reduced:
                unit.reduce()
        self._wait_for_reduce_scatters()
        self._pending = False

    def _wait_for_reduce_scatters(self):
        for unit in self.units:
            unit.finish()
            unit.release()
            unit.reduced = False

    # ---- the model's interface
    def parameters(self):
        return [u.shard for u in self.units if u.trainable]

    def zero_grad(self, set_to_none=True):
        for u in self.units:
            if set_to_none:
                u.shard.grad = None
            elif u.shard.grad is not None:
                u.shard.grad[...] = 0

    def clip_grad_norm_(self, max_norm, loss_scale=1.0):
        """By the whole gradient's norm, squares summed across ranks; ``loss_scale``: a mixed-precision S."""
        shards = self.parameters()
        return clip_sharded_grad_norm_(shards, max_norm, sum_of_squares(q.grad for q in shards if q.grad is not None),
                                       [self.comm], loss_scale=loss_scale)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

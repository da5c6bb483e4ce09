"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", sec. 5; DeepSpeed's names). Stage 3 is FullyShardedDataParallel (fsdp.py).

Every rank keeps all the parameters, but the optimizer state is partitioned: the trainable
parameters live in one flat buffer, padded to a multiple of p, and rank r owns the contiguous
shard [r·S, (r+1)·S), S = Ψ_pad / p. Each rank steps only its shard, with any ordinary optimizer
built on that shard (the update is elementwise), then the shards are all-gathered back.

* stage 1: after backward, the full gradient is reduce-scattered (each rank gets the average of
  its shard's gradient); gradients stay whole until then.
* stage 2: gradients are reduce-scattered bucket by bucket *during* backward, and a parameter's
  gradient is freed as soon as it is copied into its bucket: only the shard's gradient persists.

Bytes per step: reduce-scatter + all-gather = 2(p-1)/p·Ψ·b, the same as DDP's all-reduce.
Model states per rank (fp32 Adam, K=8 bytes of state per parameter): stage 1 4Ψ + 4Ψ + 8Ψ/N,
stage 2 4Ψ + (4 + 8)Ψ/N, up to padding (DDP: 16Ψ). With float16/bfloat16 parameters the shard's
optimizer is a MixedPrecisionOptimizer (fp32 master shard + fp32 moments, K = 12): stage 1
2Ψ + 2Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, the paper's figures.
"""
from .. import memory, trace
from ..autograd.engine import queue_callback
from ..backend import LOW_PRECISION, array_module
from ..comm import broadcast, ring_all_gather, ring_reduce_scatter
from ..nn import Parameter
from ..optim.mixed_precision import MixedPrecisionOptimizer
from ..optim.optimizer import param_groups
from .clip import clip_sharded_grad_norm_, sum_of_squares
from .data_parallel import bucket_cap_bytes, check_reduce_op
from .flat_buffer import FlatParamBuffer
from .offload import CPUOffloadOptimizer, found_inf_on_any_rank


class ZeroRedundancyOptimizer:
    """``ZeroRedundancyOptimizer(params, optim.Adam, comm, stage=2, lr=1e-3)``: shards the optimizer
    state (stage 1) and the gradients (stage 2) over ``comm``. It does its own gradient
    communication: do not wrap the model in DistributedDataParallel. Call ``zero_grad()``,
    ``loss.backward()``, ``step()`` as with any optimizer. ``params`` may be parameter groups (dicts with
    per-group options such as lr and weight_decay, as in PyTorch): each group is one contiguous range
    of the flat buffer, and the shard is cut where the groups meet into one piece per group.
    ``clip_grad_norm_(max_norm)`` clips by the norm of the *full* gradient, computed across the
    shards. Frozen parameters are left out.
    float16/bfloat16 parameters get fp32 master weights (and a loss scale for fp16: backward on
    ``opt.scale(loss)``); ``offload=True`` keeps masters and optimizer state on the host; ``reduce_op="sum"``
    where backward's seed divides by the replicas (16-bit gradients), as in DDP. A
    parameter that gets no gradient in a step counts as a zero gradient: one optimizer steps the
    whole shard, so it cannot skip part of it (momentum or weight decay still moves such a
    parameter, where a single-process optimizer would skip it; DeepSpeed does the same). Gradient
    accumulation follows PyTorch: several backward calls before ``step()`` add up until
    ``zero_grad()`` (stage 2 adds each backward's reduce-scattered shard to the shard's gradient);
    ``model.zero_grad()`` works as well.
    Stage 2 differs in one case: its gradient does not outlive ``step()`` (the parameters' full
    gradients are freed, so nothing else could reset it), where PyTorch keeps adding across steps
    that no zero_grad separates."""

    def __init__(self, params, optimizer_class, comm, stage=1, bucket_cap_mb=25.0, loss_scale="auto",
                 offload=False, reduce_op="mean", **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ZeroRedundancyOptimizer does stages 1 and 2 (stage 3 is FullyShardedDataParallel), got {stage}")
        self.comm, self.stage = comm, stage
        self.reduce_op = check_reduce_op(reduce_op, "ZeroRedundancyOptimizer")
        cap = bucket_cap_bytes(bucket_cap_mb, "ZeroRedundancyOptimizer")
        groups = param_groups(params, "ZeroRedundancyOptimizer")     # parameters, or PyTorch's groups
        for q in (q for g in groups for q in g["params"]):   # frozen ones too: every rank runs rank 0's model
            if not q.requires_grad:
                broadcast(comm, q.data, root=0)
        # the trainable parameters become views of one flat buffer, laid out in reverse (backward)
        # order, so that each parameter group is one contiguous range of it
        self.flat = FlatParamBuffer(reversed([q for g in groups for q in g["params"] if q.requires_grad]),
                                    comm.size, comm.rank, who="ZeRO")
        self.flat.point_params_at()
        broadcast(comm, self.flat.data, root=0)      # every rank starts from rank 0's parameters
        self.shard = Parameter(self.flat.shard())
        xp = self.flat.xp
        self.shard_grad = xp.zeros(self.flat.shard_size, dtype=self.flat.dtype)
        # the shard cut where the groups meet: one piece per group (maybe empty), stepped with its options
        self._piece_ranges = self._group_ranges(groups)
        self.pieces = [self.shard] if len(groups) == 1 else [Parameter(self.flat.data[lo:hi])
                                                             for lo, hi in self._piece_ranges]
        shard_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [piece]}
                        for g, piece in zip(groups, self.pieces)]
        if offload:
            # ZeRO-Offload: the shard's fp32 master weights and optimizer state on the host
            self.optimizer = CPUOffloadOptimizer(shard_groups, optimizer_class, loss_scale=loss_scale,
                                                 all_reduce_found_inf=found_inf_on_any_rank(comm), **defaults)
        elif self.flat.dtype in LOW_PRECISION:
            # mixed precision: the shard's fp32 master weights live in the optimizer (K = 12)
            self.optimizer = MixedPrecisionOptimizer(shard_groups, optimizer_class, loss_scale=loss_scale,
                                                     all_reduce_found_inf=found_inf_on_any_rank(comm), **defaults)
        else:
            self.optimizer = optimizer_class(shard_groups, **defaults)
        self.param_groups = self.optimizer.param_groups
        self._tracker = memory.tracker()
        if stage == 1:
            # .grad of every parameter is a view of one flat gradient buffer (4Ψ, this rank's sum
            # over the backward calls since zero_grad, kept whole); the reduce-scatter lands in a
            # shard-sized communication buffer, which the shard's optimizer reads as its gradient.
            # Counted as a communication buffer, under the key the shard's .grad setter uses: once
            self.flat_grad = self.flat.new()
            self._point_grads_at_flat()
            self._tracker.add("comm_buffers", ("grads", id(memory.owner(self.shard_grad))), self.shard_grad.nbytes)
        else:
            self._build_buckets(cap, xp)

    def _group_ranges(self, groups):
        """This rank's part [lo, hi) of each group's contiguous range of the flat buffer; lo == hi
        where the shard misses a group (the padding, zeros with zero gradients, is in no piece)."""
        s0, s1 = self.flat.shard_range
        ranges = []
        for g in groups:
            offsets = [self.flat.offsets[id(q)] for q in g["params"] if q.requires_grad]
            lo, hi = (min(a for a, _ in offsets), max(b for _, b in offsets)) if offsets else (s0, s0)
            ranges.append((min(max(lo, s0), s1), max(min(hi, s1), s0)))
        return ranges

    def _set_shard_grad(self, grad):
        """The shard's gradient (None or the shard gradient buffer) and each piece's view of it."""
        self.shard.grad = grad
        if len(self.pieces) > 1:
            s0 = self.flat.shard_range[0]
            for piece, (lo, hi) in zip(self.pieces, self._piece_ranges):
                piece.grad = None if grad is None else grad[lo - s0:hi - s0]

    def _point_grads_at_flat(self):
        for q in self.flat.params:
            view = self.flat.view(q, self.flat_grad)
            if q.grad is None:                      # model.zero_grad() set it None, and no gradient came
                view[...] = 0
            elif q.grad is not view and memory.owner(q.grad) is not self.flat_grad:
                view[...] = q.grad                  # a gradient made elsewhere (model.zero_grad() set None)
            q.grad = view

    # ---- stage 2: buckets reduce-scattered during backward
    def _build_buckets(self, cap, xp):
        """Contiguous ranges of the flat buffer, in backward order (the buffer is laid out reversed)."""
        self.buckets, start, size = [], 0, 0
        itemsize = self.flat.data.itemsize
        self._bucket_of = {}
        for q in self.flat.params:
            lo, hi = self.flat.offsets[id(q)]
            if size and (hi - start) * itemsize > cap:
                self.buckets.append({"range": (start, lo), "params": [], "ready": set(), "work": None})
                start = lo
            size = hi - start
        self.buckets.append({"range": (start, self.flat.padded), "params": [], "ready": set(), "work": None})
        for q in self.flat.params:
            lo, _ = self.flat.offsets[id(q)]
            bucket = next(b for b in self.buckets if b["range"][0] <= lo < b["range"][1])
            bucket["params"].append(q)
            self._bucket_of[id(q)] = bucket
            q.register_post_accumulate_grad_hook(self._grad_ready)
        self.staging = self.flat.new()                                            # the buckets' buffer
        self._tracker.add("comm_buffers", ("zero2_staging", id(self)), self.staging.nbytes)
        self._pending = False
        self._accumulating = False
        self._stepped = False                       # a step since the last backward: start a new gradient
        self._scratch = None

    def _grad_ready(self, q):
        if not self._pending:
            self._pending = True
            self._next_bucket = 0
            # gradients add up over backward calls until zero_grad (PyTorch): a second backward
            # reduce-scatters into a scratch shard, added to the shard's gradient at the end
            self._accumulating = self.shard.grad is not None and not self._stepped
            self._stepped = False
            if self._accumulating and self._scratch is None:
                self._scratch = array_module(self.shard_grad).zeros_like(self.shard_grad)
                self._tracker.add("comm_buffers", ("zero2_scratch", id(self)), self._scratch.nbytes)
            queue_callback(self._finish_backward)
        bucket = self._bucket_of[id(q)]
        lo, hi = self.flat.offsets[id(q)]
        self.staging[lo:hi] = q.grad.reshape(-1)
        q.grad = None                               # stage 2: the full gradient is not kept
        bucket["ready"].add(id(q))
        # complete buckets go in bucket order, never past an incomplete one: every rank must issue
        # the same reduce-scatters in the same order, even where ranks used different parameters
        while self._next_bucket < len(self.buckets) and len(self.buckets[self._next_bucket]["ready"]) == \
                len(self.buckets[self._next_bucket]["params"]):
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket):
        a, b = bucket["range"]
        s0, s1 = self.flat.shard_range
        size = self.flat.shard_size
        # the slice of this bucket that each rank owns
        bounds = [min(max(j * size, a), b) - a for j in range(self.comm.size)] + [b - a]
        target = self._scratch if self._accumulating else self.shard_grad
        out = target[max(a, s0) - s0:max(min(b, s1), s0) - s0]
        bucket["work"] = ring_reduce_scatter(self.comm, self.staging[a:b], op=self.reduce_op, out=out,
                                             bounds=bounds, async_op=True)

    def _finish_backward(self):
        for bucket in self.buckets[self._next_bucket:]:   # parameters without a gradient count as zeros
            for q in bucket["params"]:
                if id(q) not in bucket["ready"]:
                    lo, hi = self.flat.offsets[id(q)]
                    self.staging[lo:hi] = 0
            self._launch(bucket)
        with trace.span("wait for reduce-scatter", kind="comm"):
            for bucket in self.buckets:
                bucket["work"].wait()
                bucket["work"] = None
                bucket["ready"].clear()
        if self._accumulating:
            self.shard_grad += self._scratch
        self._set_shard_grad(self.shard_grad)
        self._pending = False

    # ---- the optimizer interface
    def zero_grad(self, set_to_none=True):
        if self.stage == 1:
            self.flat_grad[...] = 0                 # the views stay; the engine accumulates into them
            self._point_grads_at_flat()
        else:
            self.shard_grad[...] = 0
            self._set_shard_grad(None)
            for q in self.flat.params:
                q.grad = None

    def _reduce_scatter_stage1(self):
        """The flat gradient (this rank's sum over every backward since zero_grad) is left as it
        is: the averaged shard lands in its own buffer, which the shard's optimizer reads."""
        self._point_grads_at_flat()
        with trace.span("reduce-scatter gradients", kind="comm"):
            ring_reduce_scatter(self.comm, self.flat_grad, op=self.reduce_op, out=self.shard_grad)
        self._set_shard_grad(self.shard_grad)

    def scale(self, loss):
        """Mixed precision: the loss times the loss scale (call backward on it); else the loss."""
        return self.optimizer.scale(loss) if hasattr(self.optimizer, "scale") else loss

    def clip_grad_norm_(self, max_norm):
        """Clip by the L2 norm of the full gradient: squares summed over each shard, then all-reduced."""
        if self.stage == 1 and self.shard.grad is None:
            self._reduce_scatter_stage1()
        # with a loss scale S the gradients are S times too large: the true norm is total / S
        return clip_sharded_grad_norm_([self.shard], max_norm, sum_of_squares([self.shard.grad]), [self.comm],
                                       loss_scale=getattr(self.optimizer, "loss_scale", 1.0))

    def step(self):
        if self.stage == 1 and self.shard.grad is None:
            self._reduce_scatter_stage1()
        self.optimizer.step()                       # updates the shard, a view of the flat buffer
        with trace.span("all-gather parameters", kind="comm"):
            ring_all_gather(self.comm, self.flat.shard().copy(), total=self.flat.padded, out=self.flat.data)
        # the step consumes the shard's gradient: stage 1 reduce-scatters afresh at the next step, and
        # stage 2's next backward starts a new one into the same buffer (the full gradients are gone,
        # so model.zero_grad() could not reset it; DeepSpeed's engine does the same)
        if self.stage == 1:
            self._set_shard_grad(None)
        else:
            self._stepped = True

    def add_param_group(self, param_group):
        """Refused, where PyTorch's optimizers take a group later: the flat buffer and the shards are cut once,
        in the constructor."""
        raise NotImplementedError(f"{type(self).__name__}.add_param_group: the flat buffer and the shards are cut "
                                  "once, in the constructor: pass every parameter group to it")

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        """The inverse of ``state_dict()``: this rank's shard state, on the same ranks and parameters."""
        self.optimizer.load_state_dict(state_dict)

    # ---- the checkpoint's view (minitrain.sharded): the shard's state cut back into parameters
    def _shard_placements(self, placements):
        """Where this rank's flat shard sits in the parameters' logical tensors (padding excluded);
        ``placements``: the parameters' own (each whole, as ZeRO-1/2 keep them on every rank)."""
        names = {}
        for q in self.flat.params:
            (name, piece), = placements[id(q)]
            if piece.sizes != tuple(q.shape):
                raise ValueError(f"ZeRO-1/2 expect whole parameters; {name} is a slice {piece}")
            names[id(q)] = name
        if len(self.pieces) == 1:
            return {id(self.shard): self.flat.shard_slices(names)}
        return {id(piece): self.flat.shard_slices(names, lo, hi)
                for piece, (lo, hi) in zip(self.pieces, self._piece_ranges)}

    def sharded_state_dict(self, placements):
        """The shard optimizer's state (moments, fp32 masters) as slices of the parameters' logical tensors."""
        return self.optimizer.sharded_state_dict(self._shard_placements(placements))

    def load_sharded_state_dict(self, reader, placements, scalars):
        self.optimizer.load_sharded_state_dict(reader, self._shard_placements(placements), scalars)


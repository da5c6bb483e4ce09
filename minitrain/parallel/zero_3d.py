"""ZeRO on the data-parallel axis of a 3D mesh (Rajbhandari et al. 2020, "ZeRO", sec. 5; Megatron-LM's
distributed optimizer, Narayanan et al. 2021, is stage 1): GPT3D(..., zero=s) hands this class the
parameters of its rank's pipeline stage (each a tensor-parallel shard) and the communicator its pipeline
reduces gradients over (the mesh's "dp": the ranks that hold the same parameters); those are sharded.

The stage's parameters live in one flat buffer padded to a multiple of dp (flat_buffer.py), dp rank r
owning the contiguous shard [r·S, (r+1)·S). An ordinary optimizer (AdamW) steps the shard only: its
update is elementwise, so it is the single process's update restricted to the shard.

* stage 1: the gradients accumulate over the micro-batches in a persistent flat gradient buffer (the
  parameters' .grad are views of it); at the end of the step it is reduce-scattered (mean) over dp,
  instead of the pipeline's all-reduce. After the shard's update the parameters are all-gathered.
* stage 2: the same, but the flat gradient buffer lives only from the step's start to its
  reduce-scatter: between steps (the optimizer step included) a rank keeps its gradient shard only.
  Under a pipeline a gradient is final only after the last micro-batch's backward, so the full
  gradient cannot be freed during backward as the MLP job's ZeRO-2 does (DeepSpeed refuses ZeRO-2
  with pipelines for this reason); the saving is outside the step, the peak keeps the full gradient.
* stage 3: the parameters too are sharded at rest. The whole stage is gathered once per step, before
  its first micro-batch, and freed after the reduce-scatter (per stage, once per step: with m
  micro-batches the per-block, per-micro-batch gathering of fsdp.py would cost 2m all-gathers of each
  block instead of one). Between steps a rank holds Ψ/dp of everything; the peak adds the stage's
  full parameters and gradients.

Experts (per_parameter, GPT3D with MoE layers): the optimizer steps each parameter's run of the shard as
a parameter of its own, and an expert that no token of the global batch chose keeps grad None: AdamW
skips it (no weight decay, no moment or step count update) as one process does, though the flat
buffer holds a zero gradient for it.

Clipping: each rank sums the squares of its gradient shard (a tensor-parallel replica, a LayerNorm,
counted on tp rank 0 only) and the sums are added over dp, tp and pp (clip.py). Bytes per step:
reduce-scatter + all-gather = 2(dp-1)/dp·Ψ_stage·b, as the all-reduce they replace.
"""
from .. import memory, trace
from ..backend import LOW_PRECISION
from ..comm import ring_all_gather, ring_reduce_scatter
from ..nn import Parameter
from ..sharded import Slice, flat_range
from .clip import clip_sharded_grad_norm_, sum_of_squares
from .flat_buffer import FlatParamBuffer


class Zero3D:
    """``Zero3D(params, dp_comm, stage)``, then ``optimizer(optim.AdamW, lr=...)`` builds the optimizer
    on this rank's shard and returns self, which the job uses as its optimizer (``step``,
    ``param_groups``, state dicts). The model calls ``begin_step()`` before its forward passes and
    ``reduce_gradients()`` after its last backward; ``clip_grad_norm_`` clips the sharded gradient."""

    def __init__(self, params, comm, stage, per_parameter=False):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.comm, self.stage = comm, stage
        self.flat = FlatParamBuffer(params, comm.size, comm.rank, who="ZeRO")
        self.xp = self.flat.xp
        if stage < 3:
            self.flat.point_params_at()                  # the parameters are views of the flat buffer
            self.shard = Parameter(self.flat.shard())    # ... and the shard a view of it too
        else:                                            # the shard is all a rank keeps between steps
            self.shard = Parameter(self.flat.shard().copy())
            self._placeholder = self.xp.zeros((), self.flat.dtype)
            self._release_parameters()
        self.flat_grad = None
        if stage == 1:                                   # persistent (Megatron's contiguous grad buffer)
            self.flat_grad = self.flat.new()
            self._point_grads_at_flat()
            self.shard_grad = self.xp.zeros(self.flat.shard_size, self.flat.dtype)
            # the reduce-scatter lands here: a communication buffer (the flat buffer counts as grads)
            memory.tracker().add("comm_buffers", ("grads", id(memory.owner(self.shard_grad))), self.shard_grad.nbytes)
        self.inner = None
        # per_parameter (experts): the optimizer steps each parameter's run of the shard as a parameter of its
        # own, so an expert no token chose keeps grad None and its own state, as in one process
        self.pieces = self._pieces() if per_parameter else None
        self.piece_params = [Parameter(self.shard.data[a:b]) for _, a, b in self.pieces or ()]

    def _pieces(self):
        """(parameter, a, b): the run [a, b) of the shard that each parameter the shard cuts holds."""
        s0, s1 = self.flat.shard_range
        runs = [(q, max(lo, s0) - s0, min(hi, s1) - s0) for q in self.flat.params for lo, hi in [self.flat.offsets[id(q)]]]
        return [(q, a, b) for q, a, b in runs if a < b]

    def optimizer(self, optimizer_class, **defaults):
        self.inner = optimizer_class(self.piece_params if self.pieces is not None else [self.shard], **defaults)
        self.param_groups = self.inner.param_groups
        return self

    # ---- parameters and gradients around one step
    def _point_grads_at_flat(self):
        for q in self.flat.params:
            q.grad = self.flat.view(q, self.flat_grad)

    def _release_parameters(self):
        for q in self.flat.params:                       # the shape stays, the memory goes
            q.data = self.xp.broadcast_to(self._placeholder, q.shape)
        self.flat.data = None

    def gather_parameters(self):
        """Stage 3: the stage's parameters whole (an all-gather of the shards); else nothing to do."""
        if self.stage == 3 and self.flat.data is None:
            self.flat.data = self.flat.new()
            with trace.span("all-gather parameters", kind="comm"):
                ring_all_gather(self.comm, self.shard.data, total=self.flat.padded, out=self.flat.data)
            self.flat.point_params_at()

    def release_parameters(self):
        if self.stage == 3 and self.flat.data is not None:
            self._release_parameters()

    def begin_step(self):
        """Before the first forward: stage 3 gathers the parameters, stages 2 and 3 make the flat
        gradient buffer that the micro-batches' backward passes add into."""
        self.gather_parameters()
        if self.flat_grad is None:
            self.flat_grad = self.flat.new()
        if any(q.grad is None for q in self.flat.params):
            self._point_grads_at_flat()

    def reduce_gradients(self, unused=(), scale=1.0, op="mean"):
        """After the last backward: the flat gradient reduce-scattered (mean over dp) into the shard's
        gradient. Stages 2 and 3 then drop the full gradient, stage 3 the full parameters. With
        per_parameter, the parameters in ``unused`` (ids: no replica used them) get no gradient. ``scale``
        multiplies the mean (experts over their expert data-parallel group: 1/ep); op "sum" sums where each
        replica's gradient is already divided by their number (16-bit gradients, gpt_3d.py)."""
        out = self.shard_grad if self.stage == 1 else self.xp.zeros(self.flat.shard_size, self.flat.dtype)
        with trace.span("reduce-scatter gradients", kind="comm"):
            ring_reduce_scatter(self.comm, self.flat_grad, op=op, out=out)
        if scale != 1.0:
            out *= scale
        if self.stage == 1 or self.shard.grad is None:
            self.shard.grad = out
        else:                                            # a second step's gradients before zero_grad
            self.shard.grad += out
        for (q, a, b), piece in zip(self.pieces or (), self.piece_params):
            piece.grad = None if id(q) in unused else self.shard.grad[a:b]
        if self.stage >= 2:
            for q in self.flat.params:
                q.grad = None
            self.flat_grad = None
        self.release_parameters()

    def zero_grad(self):
        self.shard.grad = None
        for piece in self.piece_params:
            piece.grad = None
        if self.stage == 1:
            self.flat_grad[...] = 0                      # the views stay: backward adds into them
            self._point_grads_at_flat()

    def clip_grad_norm_(self, max_norm, groups, uncounted=(), loss_scale=1.0):
        """Clip by the norm of the whole model's gradient: the squares of this rank's shard, less the
        parameters in ``uncounted`` (ids: replicas counted on another rank), summed over dp then ``groups``
        (over ``loss_scale``: mixed precision's gradients are that many times the true ones)."""
        return clip_sharded_grad_norm_([self.shard], max_norm, self.local_square(uncounted), [self.comm, *groups],
                                       loss_scale)

    def local_square(self, uncounted=()):
        """The sum of the squares of this rank's gradient shard, less the parameters in ``uncounted``."""
        s0, s1 = self.flat.shard_range
        pieces = []
        for q in self.flat.params:
            lo, hi = self.flat.offsets[id(q)]
            if id(q) not in uncounted and max(lo, s0) < min(hi, s1):
                pieces.append(self.shard.grad[max(lo, s0) - s0:min(hi, s1) - s0])
        return sum_of_squares(pieces)

    # ---- the optimizer's interface
    def step(self, **kwargs):
        self.inner.step(**kwargs)                        # the shard's update (a view of the flat buffer below 3)
        if self.stage < 3:
            with trace.span("all-gather parameters", kind="comm"):
                ring_all_gather(self.comm, self.flat.shard().copy(), total=self.flat.padded, out=self.flat.data)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)

    # ---- the checkpoint's view (minitrain.sharded)
    def shard_placements(self, placements):
        """Where the shard's elements sit in the logical tensors: the parameters' own placements
        (``placements``: id -> [(name, Slice)], each piece a run of whole trailing rows of its
        parameter, as tensor-parallel slices are) cut by the shard's range. Padding is in none."""
        s0, s1 = self.flat.shard_range
        out = []
        for q in self.flat.params:
            base = self.flat.offsets[id(q)][0]
            for name, piece in placements[id(q)]:
                if tuple(piece.sizes[1:]) != tuple(q.shape[1:]):
                    raise ValueError(f"ZeRO cuts parameters into flat ranges; {name}'s piece {piece} is not "
                                     f"a run of whole rows of its shard {tuple(q.shape)}")
                a, b = max(base + piece.start, s0), min(base + piece.start + piece.numel, s1)
                for box in flat_range(piece.sizes, a - base - piece.start, b - base - piece.start, start=a - s0):
                    offsets = tuple(o + p for o, p in zip(box.offsets, piece.offsets))
                    out.append((name, Slice(piece.global_shape, offsets, box.sizes, box.start)))
        return out

    def _placements(self, placements):
        """Stage 3 placed the shard itself (the model's sharded_parameters); else cut the parameters'.
        With per_parameter each box goes to the piece that holds it (a box lies in one parameter)."""
        shard = placements[id(self.shard)] if id(self.shard) in placements else self.shard_placements(placements)
        if self.pieces is None:
            return {id(self.shard): shard}
        out = {id(piece): [] for piece in self.piece_params}
        for name, box in shard:
            for (_, a, b), piece in zip(self.pieces, self.piece_params):
                if a <= box.start < b:
                    out[id(piece)].append((name, box._replace(start=box.start - a)))
        return out

    def sharded_state_dict(self, placements):
        return self.inner.sharded_state_dict(self._placements(placements))

    def load_sharded_state_dict(self, reader, placements, scalars):
        self.inner.load_sharded_state_dict(reader, self._placements(placements), scalars)

    # ---- what the memory should be (the job prints it beside the ledger)
    def expected_bytes(self, optimizer_states=2):
        """Model states per rank by this layout: {'params', 'grads', 'optimizer_state'} in bytes between
        steps (``optimizer_states`` arrays the size of the shard: AdamW's two moments; 16-bit parameters'
        in fp32, beside the shard's fp32 master weights: mixed precision's K = 12 bytes per element)."""
        b, whole, shard = self.shard.data.itemsize, self.flat.padded, self.flat.shard_size
        stepped = shard if self.pieces is None else sum(b_ - a for _, a, b_ in self.pieces)   # no padding
        state = 4 * (optimizer_states + 1) if self.shard.dtype in LOW_PRECISION else b * optimizer_states
        return {"params": b * (shard if self.stage == 3 else whole),
                "grads": b * (whole if self.stage == 1 else shard),
                "optimizer_state": stepped * state}

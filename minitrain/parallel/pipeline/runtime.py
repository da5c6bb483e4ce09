"""The pipeline runtime: executes a schedule (schedules.py) on real ranks.

PipelineParallel(model, comm, "1f1b", num_microbatches=8) cuts an nn.Sequential into
p·v contiguous virtual stages (balanced by counted cost, partition.py, unless split_points
says where), keeps the ones this rank owns (as the schedule places them: the interleaved loop or
zbv's V; the other layers' weights are freed) and runs train_step(x, y, loss_fn): the global
batch is cut into m micro-batches, this rank's actions run in the schedule's order, and each
parameter ends with the gradient of the mean loss over the whole batch, as one process computes.
The step ends with an all-reduce of the loss: every rank leaves it together.

Why it cannot deadlock: every send is non-blocking (isend; the buffers are kept until the end
of the step), a receive posted ahead never blocks, and an action's receive blocks until its
message is there. A rank therefore only ever waits for a message that a dependency of its current
action produces; the checker proved that the actions' dependency graph, in each stage's order,
has no cycle. The messages (tags, headers, receives posted ahead, how to wait): messages.py;
moving them while a rank computes, where MPI needs it: progress.py.

Zero-bubble schedules (W actions): B runs out.backward(grad) inside
autograd.defer_weight_grads(stage weights), which computes the input gradient only and queues
the weight gradients; W runs the queue. With dp_comm the gradients are averaged over it once per step (2D: dp x pp); with
find_unused_parameters (an expert no token of a replica chose) as DDP's: a parameter without a
gradient on some replica counts as zeros there, one that no replica used keeps grad None.

PipeDream-2BW: double-buffered weights (weight_stash.py); batch t runs forward and backward on the
stashed W(t-1) while the optimizer updates W(t). One batch per train_step (it flushes, so that the
step returns); the schedule and the simulator show the no-flush timing of several batches chained.
"""
import numpy as np

from ... import trace
from ...autograd import Tensor, defer_weight_grads
from ...backend import array_module
from ...comm import broadcast
from ...nn import Sequential
from ...sharded import whole
from . import forward_only, measure
from .messages import TAG_LIMIT, StageMessages
from .partition import (balanced_split_points, counted_costs, own_stages, parameter_costs, stage_layout,
                        stage_table)
from .progress import ComputeProgress
from .schedules import SPLIT_BACKWARD, default_chunks, get_schedule, microbatch_sizes, placement, virtual_stage
from .simulator import check_schedule, formula_bubble_fraction
from .stamps import StepRecords
from .step_end import all_reduce_dp_gradients, all_reduce_loss
from .weight_stash import WeightStash

__all__ = ["PipelineParallel", "balanced_split_points"]


class _Step:
    """One train_step's batch, and what its actions leave for later ones (by micro-batch, chunk)."""

    def __init__(self, x, y, loss_fn, starts, weights, xp, loss_scale):
        self.x, self.y, self.loss_fn, self.starts, self.weights, self.xp = x, y, loss_fn, starts, weights, xp
        self.loss_scale = loss_scale        # backward's seed: each micro-batch's loss weight times it
        self.inputs, self.outputs, self.weight_grads, self.losses, self.loss_weights = {}, {}, {}, [], []


class PipelineParallel:
    on_microbatch = None    # called with the first row of each F's and B's micro-batch (GPT3D's dropout masks)

    def __init__(self, model, comm, schedule="1f1b", num_microbatches=None, chunks=None, split_points=None,
                 dp_comm=None, layer_costs=None, find_unused_parameters=False, dp_excluded=(), progress_thread=None):
        if not isinstance(model, Sequential):
            raise TypeError("PipelineParallel cuts an nn.Sequential into stages")
        self.comm, self.dp_comm = comm, dp_comm
        self.all_reduce_dp_gradients = True    # ZeRO on dp (zero_3d.py) reduce-scatters them instead
        self.dp_reduce_op = "mean"             # "sum" where the loss's seed already divides by dp (gpt_3d.py)
        self.find_unused_parameters = find_unused_parameters
        # parameters whose replicas are not dp's (expert parallelism's experts): neither broadcast nor averaged here
        self.dp_excluded = {id(q) for q in dp_excluded}
        self.p, self.rank, self.m = comm.size, comm.rank, num_microbatches
        self.v = default_chunks(schedule, chunks)
        self.schedule_name = schedule
        self.schedule = get_schedule(schedule, self.p, num_microbatches, chunks=self.v)
        check_schedule(self.schedule)
        self.split_backward = schedule in SPLIT_BACKWARD
        if 4 * num_microbatches * self.p * self.v > TAG_LIMIT:
            raise ValueError(f"{num_microbatches} micro-batches x {self.v} chunks need more message tags than "
                             f"point-to-point calls have ({TAG_LIMIT})")
        self.actions = self.schedule[self.rank]
        self.where = placement(self.schedule)             # virtual stage -> (rank, chunk)
        self.loss_rank = self.where[-1][0]
        layers = list(model)
        parts = self.p * self.v
        self.layer_costs = (list(layer_costs) if layer_costs is not None
                            else counted_costs(parameter_costs(layers)))     # F + B + W multiply-adds per row
        if len(self.layer_costs) != len(layers):
            raise ValueError(f"layer_costs has {len(self.layer_costs)} entries for {len(layers)} layers")
        bounds, where = stage_layout(self.layer_costs, schedule, self.p, self.v, split_points)   # as the planner
        split_points = bounds[1:-1]
        if len(split_points) != parts - 1 or split_points != sorted(set(split_points)) or \
                not all(0 < i < len(layers) for i in split_points):
            raise ValueError(f"split_points must be {parts - 1} increasing layer indices in 1..{len(layers) - 1}, "
                             f"got {split_points}")
        assert where == self.where, (where, self.where)
        self.bounds = bounds
        self.stage_rows = stage_table(layers, bounds, self.layer_costs, self.where)
        self.names = names = {id(q): n for n, q in model.named_parameters()}
        self.model = model
        # chunk -> this rank's virtual stage (a Sequential) and its index; parameter name -> its rank
        self.stages, self.virtual, self.owner = own_stages(model, bounds, self.where, self.rank, names)
        self._weights = {c: list(stage.parameters()) for c, stage in self.stages.items()}   # what W computes
        if dp_comm is not None and dp_comm.size > 1:
            for q in self.dp_parameters():      # data-parallel replicas start equal
                broadcast(dp_comm, q.data, root=0)
        self._stash = WeightStash()            # pipedream_2bw: the weight version W(t-1)
        self.messages = StageMessages(comm, self.p, self.v)
        self.progress = ComputeProgress(comm, progress_thread)   # where MPI moves messages only with their sender
        self._receives = [i for i, a in enumerate(self.actions) if a.recv_from not in (None, self.rank)]
        self.stamps = StepRecords(self.actions)   # the traced steps' timing (stamps.py)

    @property
    def step_records(self):
        """Per traced step, this rank's timestamps (measure.py reads them)."""
        return self.stamps.rows

    # ---- the model's interface
    def parameters(self):
        return [q for c in sorted(self.stages) for q in self.stages[c].parameters()]

    def dp_parameters(self):
        """This rank's parameters that the dp replicas hold alike (all but dp_excluded)."""
        return [q for q in self.parameters() if id(q) not in self.dp_excluded]

    def named_parameters(self):
        return [(self.names[id(q)], q) for q in self.parameters()]

    def zero_grad(self, set_to_none=True):
        for stage in self.stages.values():
            stage.zero_grad(set_to_none)

    def full_state_dict(self):
        """name -> full array, every stage's parameters gathered on every rank (under the names of
        the unwrapped model)."""
        state = {}
        local = {n: q for n, q in self.named_parameters()}
        for name, q in self.model.named_parameters():
            root = self.owner[name]
            array = local[name].data.copy() if root == self.rank else array_module(q.data).empty(q.shape, q.dtype)
            state[name] = broadcast(self.comm, array, root=root)
        return state

    # ---- one training step
    def train_step(self, x, y, loss_fn, global_rows=None, loss_scale=1.0):
        """Forward and backward of the global batch (x, y) as m micro-batches in the schedule's
        order; parameters' .grad hold the gradient of the mean loss. Returns the mean loss,
        on every rank. Only the first stage reads x and only the last reads y (every rank gets
        both: their shapes key the cache of message shapes). A batch that m does not divide is cut
        unevenly (the first n % m micro-batches one row more; with n < m some are empty) and each
        micro-batch's mean loss weighted by its rows. With dp replicas, global_rows is the rows of
        all replicas' batches together (default: n each): weights rows·dp/global_rows make the
        replicas' mean, which the dp all-reduce takes, the mean over the global batch. ``loss_scale``: backward
        starts from the loss times it (mixed precision's loss scaling, Megatron's grad_scale_func); the loss
        returned is unscaled."""
        n = len(y)
        dp = self.dp_comm.size if self.dp_comm is not None else 1
        global_rows = n * dp if global_rows is None else global_rows
        sizes = microbatch_sizes(n, self.m)
        starts = np.cumsum([0] + sizes).tolist()
        weights = [1.0 / self.m if size * self.m * dp == global_rows else size * dp / global_rows for size in sizes]
        params = self.parameters()
        xp = array_module(params[0].data) if params else np
        if self.schedule_name == "pipedream_2bw":
            current = self._stash.swap_in(self.parameters())
        self.messages.begin((tuple(np.shape(x)), tuple(np.shape(y))))
        self._step = _Step(x, y, loss_fn, starts, weights, xp, loss_scale)
        tracer = trace.tracer()
        clock = self.stamps.clock(tracer)                   # this step's timing stamps (stamps.py)
        compute = self.progress.around(clock.compute(self._compute), self.messages)     # progress.py
        self._run_actions(clock.receive(self._receive), compute, clock.send(self._send_result))
        wait_for_sends, all_reduce_gradients, all_reduce_loss = clock.closing(
            self.messages.wait_for_sends, self._all_reduce_gradients, self._all_reduce_loss)
        wait_for_sends()
        all_reduce_gradients()
        total = all_reduce_loss()
        if self.schedule_name == "pipedream_2bw":
            self._stash.swap_out(self.parameters(), current)
        if tracer.enabled:
            self.stamps.record(tracer, clock, global_rows)
        self._step = None
        return total

    def eval_step(self, x, y=None, loss_fn=None):
        """Forward only (PyTorch's schedule.eval): (the last stage's outputs on its rank, None elsewhere;
        with y and loss_fn the batch's mean loss on every rank, else None). forward_only.py says how."""
        return forward_only.eval_step(self, x, y, loss_fn)

    def _run_actions(self, receive, compute, send):
        """This rank's actions in the schedule's order: receive the input (from the neighbour stage
        that sends one), compute it (F, B or W), send the result on (to the stage that waits for it).
        The first receive from another rank is posted at once, each next one when the one before
        it is awaited, and the messages in flight are moved on before and after each compute: while
        an action computes, the next message can already land (and where MPI moves a message only
        while its sender is inside MPI, a thread moves them during the compute: progress.py)."""
        self._ahead = iter(self._receives[1:])
        if self._receives:
            self._post(self.actions[self._receives[0]])
        for action in self.actions:
            received = None
            if action.recv_from is not None:
                received = receive(action)
            else:
                self.messages.progress()
            result = compute(action, received)
            if action.send_to is not None:
                send(action, result)
            else:
                self.messages.progress()

    def _message(self, action):
        """(peer, micro-batch, receiving virtual stage, backward?) of an action's input."""
        return action.recv_from, action.microbatch, virtual_stage(action, self.rank, self.p), action.kind == "B"

    def _post(self, action):
        self.messages.post(*self._message(action), self._step.xp)

    def _receive(self, action):
        if action.recv_from != self.rank:
            following = next(self._ahead, None)
            if following is not None:
                self._post(self.actions[following])
        received = self.messages.recv(*self._message(action), self._step.xp)
        self.messages.progress()                # (timed with the receive: it moves messages)
        return received

    def _compute(self, action, received):
        if self.on_microbatch is not None and action.kind != "W":   # (B: a recomputed forward draws F's masks)
            self.on_microbatch(self._step.starts[action.microbatch])
        if action.kind == "F":
            return self._forward(action, received)
        if action.kind == "B":
            return self._backward(action, received)
        return self._weight(action)

    def _send_result(self, action, data):
        virtual = virtual_stage(action, self.rank, self.p) + (1 if action.kind == "F" else -1)
        self.messages.send(data, action.send_to, action.microbatch, virtual, action.kind == "B")
        self.messages.progress()                # after the send: the neighbour waits for it first

    def _forward(self, action, received):
        """F: the stage's forward of one micro-batch (the last stage adds the loss, weighted by the
        micro-batch's rows); returns the activation to send on."""
        step, mb, chunk = self._step, action.microbatch, action.chunk
        rows = slice(step.starts[mb], step.starts[mb + 1])
        inp = Tensor(step.x[rows]) if received is None else Tensor(received, requires_grad=True)
        out = self.stages[chunk](inp)
        step.inputs[mb, chunk] = inp
        if virtual_stage(action, self.rank, self.p) == len(self.where) - 1:
            if rows.stop == rows.start:
                out = out.sum() * 0.0                  # no rows: a zero whose backward still runs
            else:
                loss = step.loss_fn(out, step.y[rows])
                step.losses.append(loss.data)          # read once, after the step (no sync per micro-batch)
                step.loss_weights.append(step.weights[mb])
                out = loss * (step.weights[mb] * step.loss_scale)   # mean over micro-batches, by rows (scaled)
        step.outputs[mb, chunk] = out
        return out.data

    def _backward(self, action, received):
        """B: backward from the received output gradient; returns the input's gradient to send back.
        Zero-bubble schedules: the input gradient only, the weight gradients queued for W."""
        step, key = self._step, (action.microbatch, action.chunk)
        out = step.outputs.pop(key)
        if self.split_backward:
            with defer_weight_grads(self._weights[action.chunk]) as step.weight_grads[key]:
                out.backward(received)
        else:
            out.backward(received)
        return step.inputs.pop(key).grad

    def _weight(self, action):
        """W: the weight gradients B queued."""
        self._step.weight_grads.pop((action.microbatch, action.chunk)).run()

    def _all_reduce_loss(self):
        return all_reduce_loss(self.comm, self._step.losses, self._step.loss_weights, self.m)

    def _all_reduce_gradients(self):
        if self.dp_comm is not None and self.dp_comm.size > 1 and self.all_reduce_dp_gradients:
            all_reduce_dp_gradients(self.dp_comm, self.dp_parameters(), self.find_unused_parameters, self.dp_reduce_op)

    # ---- measurement (measure.py)
    def measured_bubble(self, skip_first=True, global_rows=None):
        """The measured bubble of the traced steps beside the formula and the residual per cause
        (a collective over the pipeline: every rank's records are gathered). global_rows: only the
        steps of batches that size (a job's full batches, not an epoch's short last one). See measure.py."""
        self.stamps.resolve_device_times()
        return measure.summarize(self, skip_first=skip_first, global_rows=global_rows)

    def measured_bubble_fraction(self):
        """Per rank, the measured bubble of the last traced step (a collective over the pipeline)."""
        self.stamps.resolve_device_times()
        return measure.summarize(self, skip_first=False, last_only=True)["measured_bubble_fraction_per_rank"]

    def formula_bubble_fraction(self, forward_cost=1.0, backward_cost=1.0, weight_cost=1.0):
        """(p-1)/(v·m+p-1) (naive: (p-1)/p); zb_h1 / zbv: the simulator's at the given costs."""
        return formula_bubble_fraction(self.schedule_name, self.p, self.m, self.v, forward_cost, backward_cost,
                                       weight_cost)

    # ---- the checkpoint's view (minitrain.sharded)
    def sharded_parameters(self):
        """[(parameter, [(name, whole slice)])] for the layers of this rank's stages (names of the
        unwrapped model): a pipeline cuts the model by layers, never inside a parameter."""
        return [(q, [(self.names[id(q)], whole(q.shape))]) for q in self.parameters()]

    def extra_sharded_state(self, placements):
        """PipeDream-2BW's stashed weights W(t-1) (<name>/stash), which the next step computes on:
        without them a resumed run would take another step. Other schedules keep nothing."""
        return self._stash.sharded_state(self.parameters(), placements)

    def load_extra_sharded_state(self, reader, placements):
        self._stash.load(self.parameters(), reader, placements, self.schedule_name)

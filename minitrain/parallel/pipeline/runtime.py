"""The pipeline runtime: executes a schedule (schedules.py) on real ranks.

PipelineParallel(model, comm, "1f1b", num_microbatches=8) cuts an nn.Sequential into
p·v contiguous virtual stages (balanced by counted cost, partition.py, unless split_points
says where), keeps the ones this rank owns (as the schedule places them: the interleaved loop or
zbv's V; the other layers' weights are freed) and runs train_step(x, y, loss_fn): the global
batch is cut into m micro-batches, this rank's actions run in the schedule's order, and each
parameter ends with the gradient of the mean loss over the whole batch, as one process computes.
The step ends with an all-reduce of the loss: every rank leaves it together.

Why it cannot deadlock: every send is non-blocking (isend; the buffers are kept until the end
of the step) and every receive blocks until its message is there. A rank therefore only ever waits
for a message that a dependency of its current action produces; the checker proved that the
actions' dependency graph, in each stage's order, has no cycle. Tags name (micro-batch, receiving
virtual stage, direction), so the order in which messages arrive does not matter. Two virtual
stages on one rank (the bottom of zbv's V) hand the array over without a message.

Zero-bubble schedules (W actions): B runs out.backward(grad) inside
autograd.defer_weight_grads(stage weights), which computes the input gradient only and queues
the weight gradients; W runs the queue. Messages: a small header (dtype, shape) then the array;
the header is skipped once the shapes of a batch shape are known (both ends see the same batch).
With dp_comm the gradients are averaged over it once per step (2D: dp x pp).

PipeDream-2BW: double-buffered weights; batch t runs forward and backward on the stashed W(t-1)
while the optimizer updates W(t): W(t+1) = W(t) - lr·∇L(W(t-1)) (Narayanan et al. 2021, sec. 3).
One batch per train_step (it flushes, so that the step returns); the schedule and the
simulator show the no-flush timing of several batches chained.
"""
import time

import numpy as np

from ... import backend, trace
from ...autograd import Tensor, defer_weight_grads
from ...backend import array_module, bfloat16, is_device_array
from ...comm import all_reduce, all_reduce_coalesced, broadcast
from ...nn import Sequential
from ...sharded import whole
from . import measure
from .partition import balanced_split_points, counted_costs, parameter_costs, stage_layout, stage_table
from .schedules import (SPLIT_BACKWARD, check_schedule, default_chunks, formula_bubble_fraction, get_schedule,
                        placement, virtual_stage)

_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + (
    [np.dtype(bfloat16)] if bfloat16 is not None else [])
_HEADER = 10                           # dtype code, ndim, up to 8 dimensions
_TAG_LIMIT = 32768                     # tags at and above belong to the collectives
MAX_RECORDS = 2_000                    # traced steps kept for measured_bubble()
nan = float("nan")


def _no_event():
    return None

__all__ = ["PipelineParallel", "balanced_split_points"]


class PipelineParallel:
    def __init__(self, model, comm, schedule="1f1b", num_microbatches=None, chunks=None, split_points=None,
                 dp_comm=None, layer_costs=None):
        if not isinstance(model, Sequential):
            raise TypeError("PipelineParallel cuts an nn.Sequential into stages")
        if num_microbatches is None or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.comm, self.dp_comm = comm, dp_comm
        self.p, self.rank, self.m = comm.size, comm.rank, num_microbatches
        self.v = default_chunks(schedule, chunks)
        self.schedule_name = schedule
        self.schedule = get_schedule(schedule, self.p, num_microbatches, chunks=self.v)
        check_schedule(self.schedule)
        self.split_backward = schedule in SPLIT_BACKWARD
        if 4 * num_microbatches * self.p * self.v > _TAG_LIMIT:
            raise ValueError(f"{num_microbatches} micro-batches x {self.v} chunks need more message tags than "
                             f"point-to-point calls have ({_TAG_LIMIT})")
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
        self.stages = {}                       # chunk -> Sequential of this rank's virtual stage
        self.virtual = {}                      # chunk -> its virtual stage
        self.owner = {}                        # parameter name -> rank that holds it
        for k, (stage_rank, chunk) in enumerate(self.where):
            part = layers[bounds[k]:bounds[k + 1]]
            for layer in part:
                for q in layer.parameters():
                    self.owner[names[id(q)]] = stage_rank
            if stage_rank == self.rank:
                self.stages[chunk], self.virtual[chunk] = Sequential(*part), k
        self._weights = {c: list(stage.parameters()) for c, stage in self.stages.items()}   # what W computes
        local = {id(q) for stage in self.stages.values() for q in stage.parameters()}
        xp = array_module(next(iter(model.parameters())).data)
        for q in model.parameters():            # free the layers other ranks own (shape kept)
            if id(q) not in local:
                q.data = xp.broadcast_to(xp.zeros((), q.dtype), q.shape)
        if dp_comm is not None and dp_comm.size > 1:
            for q in self.parameters():         # data-parallel replicas start equal
                broadcast(dp_comm, q.data, root=0)
        self._stash = None                     # pipedream_2bw: the weight version W(t-1)
        self._shapes = {}                      # (batch shape, mb, virtual, direction) -> (dtype code, shape)
        self.step_records = []                 # per traced step: this rank's timestamps (measure.py)
        self._device_records = []              # GPU: per traced step, the CUDA events of its compute
        self._device_reference = None          # GPU: (first CUDA event, its host time)

    # ---- the model's interface
    def parameters(self):
        return [q for c in sorted(self.stages) for q in self.stages[c].parameters()]

    def named_parameters(self):
        return [(self.names[id(q)], q) for q in self.parameters()]

    def zero_grad(self):
        for q in self.parameters():
            q.grad = None

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

    # ---- messages
    def _tag(self, mb, virtual, backward, part):
        """Tags name the micro-batch and the *receiving* virtual stage: unique within a step."""
        return 4 * (mb * self.p * self.v + virtual) + 2 * int(backward) + part

    def _send(self, array, dest, mb, virtual, backward):
        if dest == self.rank:                  # the next virtual stage is this rank's other chunk
            self._handoff[mb, virtual, backward] = array
            return
        array = array if array.flags.c_contiguous else array_module(array).ascontiguousarray(array)
        key = (self._batch_key, mb, virtual, backward)
        if key not in self._shapes:            # first time for this batch shape: say what comes
            header = np.zeros(_HEADER, np.int64)
            header[0], header[1] = _DTYPES.index(array.dtype), array.ndim
            header[2:2 + array.ndim] = array.shape
            self._shapes[key] = (int(header[0]), array.shape)
            self._pending.append((self.comm.isend(header, dest, self._tag(mb, virtual, backward, 0)), header))
        self._pending.append((self.comm.isend(array, dest, self._tag(mb, virtual, backward, 1)), array))

    def _recv(self, source, mb, virtual, backward, xp):
        if source == self.rank:
            return self._handoff.pop((mb, virtual, backward))
        key = (self._batch_key, mb, virtual, backward)
        if key not in self._shapes:
            header = self.comm.recv(np.zeros(_HEADER, np.int64), source, self._tag(mb, virtual, backward, 0))
            self._shapes[key] = (int(header[0]), tuple(int(d) for d in header[2:2 + int(header[1])]))
        code, shape = self._shapes[key]
        return self.comm.recv(xp.empty(shape, _DTYPES[code]), source, self._tag(mb, virtual, backward, 1))

    # ---- one training step
    def train_step(self, x, y, loss_fn, global_rows=None):
        """Forward and backward of the global batch (x, y) as m micro-batches in the schedule's
        order; parameters' .grad hold the gradient of the mean loss. Returns the mean loss,
        on every rank. Only the first stage reads x and only the last reads y (every rank gets
        both: their shapes key the cache of message shapes). A batch that m does not divide is cut
        unevenly (the first n % m micro-batches one row more; with n < m some are empty) and each
        micro-batch's mean loss weighted by its rows. With dp replicas, global_rows is the rows of
        all replicas' batches together (default: n each): weights rows·dp/global_rows make the
        replicas' mean, which the dp all-reduce takes, the mean over the global batch."""
        n = len(y)
        dp = self.dp_comm.size if self.dp_comm is not None else 1
        global_rows = n * dp if global_rows is None else global_rows
        sizes = [n // self.m + (1 if i < n % self.m else 0) for i in range(self.m)]
        starts = np.cumsum([0] + sizes).tolist()
        weights = [1.0 / self.m if size * self.m * dp == global_rows else size * dp / global_rows for size in sizes]
        params = self.parameters()
        xp = array_module(params[0].data) if params else np
        if self.schedule_name == "pipedream_2bw":
            current = self._swap_in_stash()
        self._pending, self._handoff, self._batch_key = [], {}, (tuple(np.shape(x)), tuple(np.shape(y)))
        inputs, outputs, weight_grads, losses, loss_weights = {}, {}, {}, [], []
        tracer = trace.tracer()
        clock = time.perf_counter
        event = backend.record_event if tracer.enabled else _no_event    # traced, on the GPU: a CUDA event
        stamps = [[nan] * 6 for _ in self.actions]          # per action: compute, receive, send (measure.py)
        device_times = []                                   # GPU: (action index, CUDA events around its compute)
        step_start = clock()
        for index, action in enumerate(self.actions):
            mb, chunk, kind = action.microbatch, action.chunk, action.kind
            virtual = virtual_stage(action, self.rank, self.p)
            times = stamps[index]
            if kind == "W":
                times[0], first = clock(), event()
                weight_grads.pop((mb, chunk)).run()
                times[1], last = clock(), event()
                if first is not None:
                    device_times.append((index, first, last))
                continue
            received = None
            if action.recv_from is not None:         # waiting is bubble, not work: timed apart
                times[2] = clock()
                received = self._recv(action.recv_from, mb, virtual, kind == "B", xp)
                times[3] = clock()
            times[0], first = clock(), event()
            if kind == "F":
                rows = slice(starts[mb], starts[mb + 1])
                inp = Tensor(x[rows]) if received is None else Tensor(received, requires_grad=True)
                out = self.stages[chunk](inp)
                inputs[mb, chunk] = inp
                if virtual == len(self.where) - 1 and sizes[mb] == 0:
                    out = out.sum() * 0.0                  # no rows: a zero whose backward still runs
                elif virtual == len(self.where) - 1:
                    loss = loss_fn(out, y[rows])
                    losses.append(loss.data)               # read once, after the step (no sync per micro-batch)
                    loss_weights.append(weights[mb])
                    out = loss * weights[mb]               # mean over micro-batches, by rows
                outputs[mb, chunk] = out
            else:
                out = outputs.pop((mb, chunk))
                if self.split_backward:                    # B: input gradient; W later
                    with defer_weight_grads(self._weights[chunk]) as weight_grads[mb, chunk]:
                        out.backward(received)
                else:
                    out.backward(received)
                inp = inputs.pop((mb, chunk))
            times[1], last = clock(), event()
            if first is not None:
                device_times.append((index, first, last))
            if action.send_to is not None:
                times[4] = clock()
                data = out.data if kind == "F" else inp.grad
                self._send(data, action.send_to, mb, virtual + (1 if kind == "F" else -1), kind == "B")
                times[5] = clock()
        end = [clock()]                           # then: sends done, (dp all-reduce), loss all-reduce
        self.comm.wait_all([r for r, _ in self._pending], "pipeline sends")
        self._pending = []
        end.append(clock())
        if self.dp_comm is not None and self.dp_comm.size > 1:
            self._all_reduce_gradients()
        end.append(clock())
        total = np.array([self._mean_loss(losses, loss_weights)])    # the last stage's; 0 elsewhere
        total = all_reduce(self.comm, total, op="sum")       # every rank leaves the step together
        end.append(clock())
        if self.schedule_name == "pipedream_2bw":
            self._swap_out_stash(current)
        if tracer.enabled:
            self._record(tracer, step_start, stamps, end, device_times)
        return float(total[0])

    def _record(self, tracer, step_start, stamps, end, device_times):
        """Keep this step's timestamps for measured_bubble() and write them into the trace (after
        the step, so that tracing costs the step nothing). On the GPU the compute spans carry their
        CUDA events: their device times replace the host's when read (_resolve_device_times)."""
        sent_wait, dp, loss = end[1] - end[0], end[2] - end[1], end[3] - end[2]
        flat = [t for times in stamps for t in times]
        self.step_records.append(np.array([step_start, end[3], sent_wait + loss, dp] + flat))
        self._device_records.append(device_times)
        if device_times and self._device_reference is None:
            index, first, _ = device_times[0]
            self._device_reference = (first, stamps[index][0])    # the device clock's zero, in host time
        if len(self.step_records) > MAX_RECORDS:
            del self.step_records[1]                 # keep the first step (reported on its own) and the last ones
            del self._device_records[1]
        cuda = {index: (first, last) for index, first, last in device_times}
        tracer.add("pipeline step", "step", step_start, end[3], {})
        for index, (action, times) in enumerate(zip(self.actions, stamps)):
            args = {"microbatch": action.microbatch, "chunk": action.chunk, "index": index}
            if times[2] == times[2]:
                tracer.add(f"recv {action}", "comm", times[2], times[3], {**args, "wait": "recv"})
            tracer.add(str(action), "compute", times[0], times[1], {**args, "op": action.kind}, cuda.get(index))
            if times[4] == times[4]:
                tracer.add(f"send {action}", "comm", times[4], times[5], {**args, "wait": "send"})
        tracer.add("wait for sends", "comm", end[0], end[1], {"wait": "end"})
        if dp:
            tracer.add("all-reduce gradients (dp)", "comm", end[1], end[2], {"wait": "dp"})
        tracer.add("loss all-reduce", "comm", end[2], end[3], {"wait": "end"})

    def _resolve_device_times(self):
        """GPU: the recorded steps' compute start and end become the device's (CUDA events, on a
        clock aligned with the host's at the first traced action; waits for the GPU once)."""
        pending = [(row, times) for row, times in zip(self.step_records, self._device_records) if times]
        if not pending:
            return
        reference, host_zero = self._device_reference
        backend.elapsed_ms(reference, pending[-1][1][-1][2])             # the one wait
        for row, times in pending:
            slots = row[len(measure.HEAD):].reshape(len(self.actions), len(measure.SLOT))
            for index, first, last in times:
                slots[index, 0] = host_zero + backend.elapsed_ms(reference, first, wait=False) / 1e3
                slots[index, 1] = host_zero + backend.elapsed_ms(reference, last, wait=False) / 1e3
        self._device_records = [[] for _ in self.step_records]

    def _mean_loss(self, values, weights):
        """The mean of the micro-batches' losses as a float (on the GPU: one synchronisation)."""
        if not values:
            return 0.0
        if any(w != 1.0 / self.m for w in weights) or len(values) != self.m:     # uneven micro-batches
            xp = array_module(values[0])
            return backend.to_scalar((xp.stack(values).astype(np.float64) * xp.asarray(weights)).sum())
        if is_device_array(values[0]):
            return backend.to_scalar(array_module(values[0]).stack(values).astype(np.float64).sum()) / self.m
        return sum(float(v) for v in values) / self.m

    def _all_reduce_gradients(self):
        all_reduce_coalesced(self.dp_comm, [q.grad for q in self.parameters() if q.grad is not None], op="mean")

    # ---- PipeDream-2BW: compute on W(t-1), let the optimizer update W(t)
    def _swap_in_stash(self):
        current = [q.data.copy() for q in self.parameters()]
        if self._stash is not None:
            for q, old in zip(self.parameters(), self._stash):
                q.data[...] = old
        return current

    def _swap_out_stash(self, current):
        self._stash = current                  # W(t) becomes the version the next batch computes on
        for q, now in zip(self.parameters(), current):
            q.data[...] = now

    # ---- measurement (measure.py)
    def measured_bubble(self, skip_first=True):
        """The measured bubble of the traced steps beside the formula and the residual per cause
        (a collective over the pipeline: every rank's records are gathered). See measure.py."""
        self._resolve_device_times()
        return measure.summarize(self, skip_first=skip_first)

    def measured_bubble_fraction(self):
        """Per rank, the measured bubble of the last traced step (a collective over the pipeline)."""
        self._resolve_device_times()
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
        if self._stash is None:
            return {}
        stash = {}
        for q, old in zip(self.parameters(), self._stash):
            for name, piece in placements[id(q)]:
                stash.setdefault(f"{name}/stash", []).append((piece, piece.view(old)))
        return stash

    def load_extra_sharded_state(self, reader, placements):
        names = [placements[id(q)][0][0] for q in self.parameters()]
        saved = [reader.has(f"{name}/stash") for name in names]
        if not any(saved):
            self._stash = None                  # as at the start: the first step computes on W(t)
            return
        if self.schedule_name != "pipedream_2bw":
            raise ValueError("the checkpoint holds PipeDream-2BW's stashed weights W(t-1); only the pipedream_2bw "
                             "schedule computes on them (resume with --schedule pipedream_2bw)")
        self._stash = []
        for q, name in zip(self.parameters(), names):
            old = array_module(q.data).zeros(q.shape, q.dtype)
            reader.read_into(f"{name}/stash", placements[id(q)][0][1], old)
            self._stash.append(old)

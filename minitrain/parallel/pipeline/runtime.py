"""The pipeline runtime: executes a schedule (schedules.py) on real ranks.

PipelineParallel(model, comm, "1f1b", num_microbatches=8) cuts an nn.Sequential into
p·v contiguous virtual stages (balanced by parameter count unless split_points says where),
keeps the ones this rank owns (chunk c of rank s is virtual stage c·p + s; the other layers'
weights are freed) and runs train_step(x, y, loss_fn): the global batch is cut into m
micro-batches, this rank's actions run in the schedule's order, and each parameter ends with the
gradient of the mean loss over the whole batch, exactly what one process computes.

Why it cannot deadlock: every send is non-blocking (isend; the buffers are kept until the end
of the step) and every receive blocks until its message is there. A rank therefore only ever waits
for a message that a dependency of its current action produces; the schedule checker proved that
the dependency graph of the actions, in each stage's order, has no cycle, so the message is always
eventually sent. Each message carries a tag made of (micro-batch, chunk, direction), so the order in
which two messages between the same pair of ranks arrive does not matter.

Messages: a small header (dtype and shape) then the array. Activations go forward, gradients of
activations backward; parameters never move. With a data-parallel communicator (dp_comm,
e.g. DeviceMesh(comm, dp=2, pp=2).comm("dp")) the gradients are averaged over it once per step,
after the last micro-batch (2D: dp x pp).

PipeDream-2BW (schedule="pipedream_2bw"): double-buffered weights. The micro-batches of batch t
run forward and backward on the *stashed* version W(t-1) while the optimizer updates W(t):
W(t+1) = W(t) - lr·∇L(W(t-1)), a one-step-delayed gradient (Narayanan et al. 2021, sec. 3). The
runtime executes one batch per train_step (it flushes, so that the step returns); the schedule's
data and simulator show the no-flush timing of several batches chained.
"""
import numpy as np

from ... import backend, trace
from ...autograd import Tensor
from ...backend import array_module, bfloat16, is_device_array
from ...comm import all_reduce, broadcast
from ...nn import Sequential
from ...sharded import whole
from .schedules import check_schedule, formula_bubble_fraction, get_schedule

_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + (
    [np.dtype(bfloat16)] if bfloat16 is not None else [])
_HEADER = 10                           # dtype code, ndim, up to 8 dimensions
_TAG_LIMIT = 32768                     # tags at and above belong to the collectives


def balanced_split_points(sizes, parts):
    """Where each of ``parts`` contiguous groups of layers starts (after the first), chosen so that
    the largest group's parameter count is as small as possible (the classic linear-partition
    dynamic programme); a group of parameter-free layers alone is avoided whenever there are
    enough layers with parameters."""
    n = len(sizes)
    if n < parts:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline stages: each needs at least one layer")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    weighted = [0]
    for size in sizes:
        weighted.append(weighted[-1] + (size > 0))
    avoid_empty = weighted[-1] >= parts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]   # best[k][i]: first i layers in k groups
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if avoid_empty and weighted[i] == weighted[j]:
                    continue                              # this group would hold no parameters
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], start[k][i] = cost, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = start[k][i]
        points.append(i)
    return sorted(points)[1:]


class PipelineParallel:
    def __init__(self, model, comm, schedule="1f1b", num_microbatches=None, chunks=1, split_points=None,
                 dp_comm=None):
        if not isinstance(model, Sequential):
            raise TypeError("PipelineParallel cuts an nn.Sequential into stages")
        if num_microbatches is None or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.comm, self.dp_comm = comm, dp_comm
        self.p, self.rank, self.m, self.v = comm.size, comm.rank, num_microbatches, chunks
        self.schedule_name = schedule
        self.schedule = get_schedule(schedule, self.p, num_microbatches, chunks=chunks)
        check_schedule(self.schedule)
        if 4 * num_microbatches * self.p * chunks > _TAG_LIMIT:
            raise ValueError(f"{num_microbatches} micro-batches x {chunks} chunks need more message tags than "
                             f"point-to-point calls have ({_TAG_LIMIT})")
        self.actions = self.schedule[self.rank]
        layers = list(model)
        parts = self.p * chunks
        if split_points is None:
            split_points = balanced_split_points([sum(q.size for q in layer.parameters()) for layer in layers], parts)
        split_points = list(split_points)
        if len(split_points) != parts - 1 or split_points != sorted(set(split_points)) or \
                not all(0 < i < len(layers) for i in split_points):
            raise ValueError(f"split_points must be {parts - 1} increasing layer indices in 1..{len(layers) - 1}, "
                             f"got {split_points}")
        bounds = [0] + split_points + [len(layers)]
        self.bounds = bounds
        names = {id(q): n for n, q in model.named_parameters()}
        self.names = names
        self.model = model
        self.stages = {}                       # chunk -> Sequential of this rank's virtual stage
        self.owner = {}                        # parameter name -> rank that holds it
        for virtual in range(parts):
            stage_rank, chunk = virtual % self.p, virtual // self.p
            part = layers[bounds[virtual]:bounds[virtual + 1]]
            for layer in part:
                for q in layer.parameters():
                    self.owner[names[id(q)]] = stage_rank
            if stage_rank == self.rank:
                self.stages[chunk] = Sequential(*part)
        local = {id(q) for stage in self.stages.values() for q in stage.parameters()}
        xp = array_module(next(iter(model.parameters())).data)
        for q in model.parameters():            # free the layers other ranks own (shape kept)
            if id(q) not in local:
                q.data = xp.broadcast_to(xp.zeros((), q.dtype), q.shape)
        if dp_comm is not None and dp_comm.size > 1:
            for q in self.parameters():         # data-parallel replicas start equal
                broadcast(dp_comm, q.data, root=0)
        self._stash = None                     # pipedream_2bw: the weight version W(t-1)
        self.last_step = None

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
        array = np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array_module(array).ascontiguousarray(array)
        header = np.zeros(_HEADER, np.int64)
        header[0], header[1] = _DTYPES.index(array.dtype), array.ndim
        header[2:2 + array.ndim] = array.shape
        for part, buf in enumerate((header, array)):
            self._pending.append((self.comm.isend(buf, dest, self._tag(mb, virtual, backward, part)), buf))

    def _recv(self, source, mb, virtual, backward, xp):
        header = self.comm.recv(np.zeros(_HEADER, np.int64), source, self._tag(mb, virtual, backward, 0))
        shape = tuple(int(d) for d in header[2:2 + int(header[1])])
        return self.comm.recv(xp.empty(shape, _DTYPES[int(header[0])]), source, self._tag(mb, virtual, backward, 1))

    # ---- one training step
    def train_step(self, x, y, loss_fn):
        """Forward and backward of the global batch (x, y) as m micro-batches in the schedule's
        order; parameters' ``.grad`` hold the gradient of the mean loss. Returns the mean loss,
        on every rank. Only the first stage reads x and only the last reads y."""
        n = len(y)
        if n % self.m:
            raise ValueError(f"[rank {self.rank}] a batch of {n} is not divisible into {self.m} micro-batches")
        size = n // self.m
        xp = array_module(next(iter(self.parameters())).data) if self.parameters() else np
        if self.schedule_name == "pipedream_2bw":
            current = self._swap_in_stash()
        self._pending = []
        inputs, outputs, losses = {}, {}, {}
        last_virtual = self.p * self.v - 1
        with trace.span("pipeline step", kind="step"):
            for action in self.actions:
                mb, chunk = action.microbatch, action.chunk
                virtual = chunk * self.p + self.rank
                received = None
                if action.recv_from is not None:         # waiting is bubble, not work: its own span
                    with trace.span(f"recv {action}", kind="comm"):
                        received = self._recv(action.recv_from, mb, virtual, action.kind == "B", xp)
                with trace.span(str(action), kind="compute", microbatch=mb, chunk=chunk, op=action.kind):
                    if action.kind == "F":
                        inp = (Tensor(x[mb * size:(mb + 1) * size]) if received is None
                               else Tensor(received, requires_grad=True))
                        out = self.stages[chunk](inp)
                        inputs[mb, chunk] = inp
                        if virtual == last_virtual:
                            loss = loss_fn(out, y[mb * size:(mb + 1) * size])
                            losses[mb] = loss.data           # read once, after the step (no sync per micro-batch)
                            outputs[mb, chunk] = loss * (1.0 / self.m)     # mean over micro-batches
                        else:
                            outputs[mb, chunk] = out
                            self._send(out.data, action.send_to, mb, virtual + 1, False)
                    else:
                        out = outputs.pop((mb, chunk))
                        if received is None:
                            out.backward()
                        else:
                            out.backward(received)
                        inp = inputs.pop((mb, chunk))
                        if action.send_to is not None:
                            self._send(inp.grad, action.send_to, mb, virtual - 1, True)
            with trace.span("wait for sends", kind="comm"):
                self.comm.wait_all([r for r, _ in self._pending], "pipeline sends")
            self._pending = []
            if self.dp_comm is not None and self.dp_comm.size > 1:
                with trace.span("all-reduce gradients (dp)", kind="comm"):
                    self._all_reduce_gradients()
        if self.schedule_name == "pipedream_2bw":
            self._swap_out_stash(current)
        total = np.array([self._mean_loss(list(losses.values()))])
        return float(broadcast(self.comm, total, root=last_virtual % self.p)[0])

    def _mean_loss(self, values):
        """The mean of the micro-batches' losses as a float (on the GPU: one synchronisation)."""
        if not values:
            return 0.0
        if is_device_array(values[0]):
            return backend.to_scalar(array_module(values[0]).stack(values).astype(np.float64).sum()) / self.m
        return sum(float(v) for v in values) / self.m

    def _all_reduce_gradients(self):
        params = [q for q in self.parameters() if q.grad is not None]
        if not params:
            return
        flat = np.concatenate([q.grad.reshape(-1) for q in params]) if isinstance(params[0].grad, np.ndarray) \
            else array_module(params[0].grad).concatenate([q.grad.reshape(-1) for q in params])
        flat = all_reduce(self.dp_comm, flat, op="mean")
        offset = 0
        for q in params:
            q.grad[...] = flat[offset:offset + q.size].reshape(q.shape)
            offset += q.size

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

    # ---- measurement
    def step_timing(self, events=None):
        """(start, end, busy seconds) of the last traced step on this rank (trace.enable() first)."""
        events = trace.events() if events is None else events
        steps = [e for e in events if e["name"] == "pipeline step"]
        if not steps:
            raise RuntimeError("no traced pipeline step: call trace.enable() before train_step")
        step = steps[-1]
        busy = sum(e["end"] - e["start"] for e in events if e["kind"] == "compute" and e.get("args", {}).get("op")
                   and step["start"] <= e["start"] <= step["end"])
        return step["start"], step["end"], busy

    def measured_bubble_fraction(self, events=None, common_window=True):
        """Per rank of the pipeline, 1 - (time in F/B actions) / (the step's duration), from the trace
        of the last step. The duration is the same window for every rank, from the first rank's start
        to the last rank's end (the formula's p x total time; clocks are comparable on one host), so
        this gathers over the pipeline (a collective); ``common_window=False``: this rank's own span
        only, no communication. Returns the list over ranks (one value without the common window)."""
        start, end, busy = self.step_timing(events)
        if not common_window:
            return 1 - busy / (end - start)
        from ...comm import ring_all_gather
        rows = ring_all_gather(self.comm, np.array([start, end, busy]), total=3 * self.p).reshape(self.p, 3)
        window = rows[:, 1].max() - rows[:, 0].min()
        return [float(1 - b / window) for b in rows[:, 2]]

    def formula_bubble_fraction(self):
        return formula_bubble_fraction(self.schedule_name, self.p, self.m, self.v)

    # ---- the checkpoint's view (minitrain.sharded)
    def sharded_parameters(self):
        """[(parameter, [(name, whole slice)])] for the layers of this rank's stages (names of the
        unwrapped model): a pipeline cuts the model by layers, never inside a parameter."""
        return [(q, [(self.names[id(q)], whole(q.shape))]) for q in self.parameters()]

    def extra_sharded_state(self, placements):
        """PipeDream-2BW's stashed weights W(t-1) (``<name>/stash``), which the next step computes on:
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

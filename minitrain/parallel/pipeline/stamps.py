"""The pipeline runtime's timing stamps, taken around its phases rather than inside them.

runtime.py dispatches a step's actions through three phases: receive, compute (F, B or W), send.
A StepClock wraps each phase so that its start and end land in the action's row (measure.SLOT),
and the step's closing phases (the sends' wait, the dp all-reduce, the loss all-reduce) in the
step's head (measure.HEAD). Traced on the GPU, each compute also records two CUDA events (no
synchronisation: read once, when the bubble is measured). StepRecords keeps the traced steps for
measure.py and writes them into the trace after each step, so that tracing costs the step nothing.
"""
import time

import numpy as np

from ... import backend
from . import measure

MAX_RECORDS = 2_000                    # traced steps kept for measured_bubble()
nan = float("nan")
clock = time.perf_counter


def _no_event():
    return None


class StepClock:
    """One step's stamps: ``start``, per action [compute, receive, send] x [start, end], ``end``
    (after the actions, the sends' wait, the dp all-reduce, the loss all-reduce)."""

    def __init__(self, index, events):
        self.index = index                                  # id(action) -> its position in the rank's list
        self.event = backend.record_event if events else _no_event
        self.stamps = [[nan] * len(measure.SLOT) for _ in index]
        self.device_times = []                              # GPU: (action index, CUDA events around its compute)
        self.end = []
        self.start = clock()

    def _phase(self, slot, fn, events=False):
        def run(action, *args):
            index = self.index[id(action)]
            times = self.stamps[index]
            times[slot], first = clock(), (self.event() if events else None)
            result = fn(action, *args)
            times[slot + 1], last = clock(), (self.event() if events else None)
            if first is not None:
                self.device_times.append((index, first, last))
            return result
        return run

    def receive(self, fn):
        """``fn(action)`` timed apart: waiting for a message is bubble, not work."""
        return self._phase(2, fn)

    def compute(self, fn):
        return self._phase(0, fn, events=True)

    def send(self, fn):
        return self._phase(4, fn)

    def closing(self, *fns):
        """The step's closing phases, in order: each one's end is stamped (the first's start too)."""
        def timed(fn, first):
            def run(*args):
                if first:
                    self.end.append(clock())
                result = fn(*args)
                self.end.append(clock())
                return result
            return run
        return [timed(fn, i == 0) for i, fn in enumerate(fns)]


class StepRecords:
    """The traced steps of one pipeline rank: ``rows`` (measure.py's records), the CUDA events of
    their computes, and the device clock's zero."""

    def __init__(self, actions):
        self.actions = actions
        self.index = {id(a): i for i, a in enumerate(actions)}
        assert len(self.index) == len(actions), "an action object appears twice in a rank's schedule"
        self.rows = []                      # per traced step: this rank's timestamps (measure.py)
        self.batch_rows = []                # per traced step: its batch's rows (global_rows)
        self.device_records = []            # GPU: per traced step, the CUDA events of its compute
        self.device_reference = None        # GPU: (first CUDA event, its host time)

    def clock(self, tracer):
        return StepClock(self.index, events=tracer.enabled)

    def record(self, tracer, step, batch_rows):
        """Keep this step's stamps and its batch's rows for measured_bubble(), and write them into the
        trace. On the GPU the compute spans carry their CUDA events: their device times replace the
        host's when read (resolve_device_times)."""
        stamps, end, device_times = step.stamps, step.end, step.device_times
        sent_wait, dp, loss = end[1] - end[0], end[2] - end[1], end[3] - end[2]
        flat = [t for times in stamps for t in times]
        self.rows.append(np.array([step.start, end[3], sent_wait + loss, dp] + flat))
        self.device_records.append(device_times)
        self.batch_rows.append(batch_rows)
        if device_times and self.device_reference is None:
            index, first, _ = device_times[0]
            self.device_reference = (first, stamps[index][0])    # the device clock's zero, in host time
        if len(self.rows) > MAX_RECORDS:
            del self.rows[1]                    # keep the first step (reported on its own) and the last ones
            del self.device_records[1]
            del self.batch_rows[1]
        cuda = {index: (first, last) for index, first, last in device_times}
        tracer.add("pipeline step", "step", step.start, end[3], {})
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

    def resolve_device_times(self):
        """GPU: the recorded steps' compute start and end become the device's (CUDA events, on a
        clock aligned with the host's at the first traced action; waits for the GPU once)."""
        pending = [(row, times) for row, times in zip(self.rows, self.device_records) if times]
        if not pending:
            return
        reference, host_zero = self.device_reference
        backend.elapsed_ms(reference, pending[-1][1][-1][2])             # the one wait
        for row, times in pending:
            slots = row[len(measure.HEAD):].reshape(len(self.actions), len(measure.SLOT))
            for index, first, last in times:
                slots[index, 0] = host_zero + backend.elapsed_ms(reference, first, wait=False) / 1e3
                slots[index, 1] = host_zero + backend.elapsed_ms(reference, last, wait=False) / 1e3
        self.device_records = [[] for _ in self.rows]

"""What the data-parallel strategies cost, attached from outside them.

data_parallel.py and fsdp.py read as their papers; each class carries one decorator from here
that wraps a few of its methods with the machinery the jobs report (PyTorch attaches its comm
hooks and profiler ranges the same way, around the algorithm rather than inside it):

* memory ledger (memory.py): DDP's bucket buffers and FSDP's gradient staging buffers are
  comm_buffers, for as long as they live;
* trace spans (trace.py, the jobs' --trace): the parameters' broadcast, the waits for DDP's
  buckets, FSDP's all-gathers and reduce-scatters, LocalSGD's averaging;
* bytes: DDP's step_bytes_sent, what the last synchronised backward sent (comm.stats).
"""
import functools
import weakref

from .. import memory, trace


def _wrap(cls, name, make):
    """Replace method ``name`` of ``cls`` by ``make(original)``."""
    original = getattr(cls, name)
    setattr(cls, name, functools.wraps(original)(make(original)))


def _traced(cls, name, label):
    """Method ``name`` runs inside a comm span named ``label(self)``."""
    def make(original):
        def method(self, *args, **kwargs):
            with trace.span(label(self), kind="comm"):
                return original(self, *args, **kwargs)
        return method
    _wrap(cls, name, make)


def _release(tracker, keys):
    for key in keys:
        tracker.remove(key)


def ddp(cls):
    """DistributedDataParallel: its buckets' two flat buffers (gradients in, averages out) are
    comm_buffers until the wrapper is collected; step_bytes_sent counts from the first gradient
    of a synchronised backward to the end of its last bucket's wait."""
    _traced(cls, "_broadcast_parameters", lambda self: "broadcast parameters")
    _traced(cls, "_wait_for_buckets", lambda self: "wait for buckets")

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            tracker = memory.tracker()
            keys = [("ddp_bucket", id(self), b.index) for b in self.buckets]
            for key, bucket in zip(keys, self.buckets):
                tracker.add("comm_buffers", key, bucket.flat.nbytes + bucket.reduced.nbytes)
            weakref.finalize(self, _release, tracker, keys)
            self.step_bytes_sent = 0
        return __init__

    def make_grad_ready(original):
        def _grad_ready(self, param):
            if self._sync and not self._pending:          # the first gradient of this backward
                self.step_bytes_sent = 0
                self._bytes_before = self.comm.stats.bytes_sent
            original(self, param)
        return _grad_ready

    def make_finish(original):
        def _finish(self):
            original(self)
            self.step_bytes_sent = self.comm.stats.bytes_sent - self._bytes_before
        return _finish

    _wrap(cls, "__init__", make_init)
    _wrap(cls, "_grad_ready", make_grad_ready)
    _wrap(cls, "_finish", make_finish)
    return cls


def local_sgd(cls):
    _traced(cls, "synchronize", lambda self: "average parameters")
    return cls


def fsdp_unit(cls):
    """An FSDP unit: its all-gather's wait is a span; its staging buffer (the full gradients the
    reduce-scatter reads) is comm_buffers from its making to the unit's finish."""
    _traced(cls, "_wait_for_gather", lambda self: f"all-gather {self.name}")

    def make_staging_buffer(original):
        def staging_buffer(self):
            new = self.staging is None
            buffer = original(self)
            if new:
                memory.tracker().add("comm_buffers", ("fsdp_staging", id(self)), buffer.nbytes)
            return buffer
        return staging_buffer

    def make_finish(original):
        def finish(self):
            had = self.staging is not None
            original(self)
            if had:
                memory.tracker().remove(("fsdp_staging", id(self)))
        return finish

    _wrap(cls, "staging_buffer", make_staging_buffer)
    _wrap(cls, "finish", make_finish)
    return cls


def fsdp(cls):
    _traced(cls, "_wait_for_reduce_scatters", lambda self: "wait for reduce-scatter")
    return cls

"""torch.distributed's async Work over comm's: a call with async_op=True returns one, whose wait() finishes
the call (writes the result into the caller's tensors, where PyTorch's call puts it) and returns True."""
from .groups import seconds


class Work:
    """A Work whose wait() also writes its result where PyTorch's call puts it."""

    def __init__(self, work, finish):
        self.work, self.finish, self.finished = work, finish, False

    def is_completed(self):
        return self.work.is_completed()

    def wait(self, timeout=None):
        """Finish the call; ``timeout`` (PyTorch's timedelta, or seconds; 0: none) bounds the wait."""
        result = self.work.wait(seconds(timeout) or None)
        if not self.finished:
            self.finished = True
            self.finish(result)
        return True


def run(async_op, call, finish):
    """``call(async_op)`` then ``finish(result)``: now, or in the returned Work's wait()."""
    if async_op:
        return Work(call(True), finish)
    finish(call(False))
    return None


def into(dst):
    def write(result):
        dst[...] = result.reshape(dst.shape)
    return write

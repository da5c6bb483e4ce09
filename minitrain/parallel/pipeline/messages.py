"""The pipeline's stage-to-stage messages: tags, headers, receives posted ahead, the waiting policy.

Tags name (micro-batch, receiving virtual stage, direction), so the order in which messages arrive
does not matter. A message is a small header (dtype, shape) then the array; the header is skipped
once the shapes of a batch shape are known (both ends see the same batch). Once they are, the
receive of a rank's next receiving action is posted (irecv) while the current one is still
awaited, and progress() (called around each compute) tests what is in flight: a large message
moves only while one of its ends is inside MPI, so without it the copy waited for the receive to
start. Two virtual stages on one rank (the bottom of zbv's V) hand the array over without a
message. Every send is non-blocking; its buffer is kept until the end of the step.

Waiting: a pipeline's receive is idle time in the schedule, and what it costs is how late the
waiter runs again after the message is there. The communicator's default (sched_yield for 10 ms,
then sleeps of up to 1 ms) burns the core while it yields and wakes up to 1 ms late after; sleeping
at once, 0.2 ms at most, woke 0.19-0.23 ms after the send for 7-11% of the core while waiting
(the default: 0.18 ms after a 3 ms wait, 0.67 ms after a 15 ms one, for 38-100% of the core;
2 ranks on 2 shared cores). The pipeline's own neighbour needs that core more than the poll.
"""
import numpy as np

from ...backend import array_module, bfloat16

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + (
    [np.dtype(bfloat16)] if bfloat16 is not None else [])
HEADER = 10                            # dtype code, ndim, up to 8 dimensions
TAG_LIMIT = 32768                      # tags at and above belong to the collectives
POLL = (0.0, 2e-4)                     # wait_all: no sched_yield, sleep at most 0.2 ms


class StageMessages:
    """One rank's messages to and from its neighbour stages. begin() starts a step (batch_key:
    what the shapes are cached under); send / post / recv name a message by (peer, micro-batch,
    receiving virtual stage, backward?)."""

    def __init__(self, comm, p, v, poll=POLL):
        self.comm, self.p, self.v, self.rank, self.poll = comm, p, v, comm.rank, poll
        self.shapes = {}                   # (batch key, mb, virtual, backward) -> (dtype code, shape)
        self.sends, self.handoff, self.posted, self.batch_key = [], {}, {}, None
        self.moving = []                   # sends not yet seen complete (progress tests them)

    def tag(self, mb, virtual, backward, part):
        """Unique within a step: the micro-batch, the *receiving* virtual stage, the direction, header/array."""
        return 4 * (mb * self.p * self.v + virtual) + 2 * int(backward) + part

    def begin(self, batch_key):
        self.sends, self.handoff, self.posted, self.batch_key, self.moving = [], {}, {}, batch_key, []

    def send(self, array, dest, mb, virtual, backward):
        if dest == self.rank:              # the next virtual stage is this rank's other chunk
            self.handoff[mb, virtual, backward] = array
            return
        array = array if array.flags.c_contiguous else array_module(array).ascontiguousarray(array)
        key = (self.batch_key, mb, virtual, backward)
        if key not in self.shapes:         # first time for this batch shape: say what comes
            header = np.zeros(HEADER, np.int64)
            header[0], header[1] = DTYPES.index(array.dtype), array.ndim
            header[2:2 + array.ndim] = array.shape
            self.shapes[key] = (int(header[0]), array.shape)
            self.sends.append((self.comm.isend(header, dest, self.tag(mb, virtual, backward, 0)), header))
        self.sends.append((self.comm.isend(array, dest, self.tag(mb, virtual, backward, 1)), array))
        self.moving.append(self.sends[-1][0])

    def progress(self):
        """Test the receives posted ahead and the sends still moving (a failure is left for the
        wait that owns the request to report)."""
        try:
            for request, _ in self.posted.values():
                request.test()
            self.moving = [request for request in self.moving if not request.test()]
        except Exception:
            pass

    def post(self, source, mb, virtual, backward, xp):
        """Post the receive now if its shape is known (else recv will, after the header)."""
        key = (self.batch_key, mb, virtual, backward)
        if source == self.rank or key not in self.shapes or key in self.posted:
            return
        code, shape = self.shapes[key]
        buf = xp.empty(shape, DTYPES[code])
        self.posted[key] = (self.comm.irecv(buf, source, self.tag(mb, virtual, backward, 1)), buf)

    def recv(self, source, mb, virtual, backward, xp):
        """The array: handed over, from the receive posted ahead, or received now."""
        if source == self.rank:
            return self.handoff.pop((mb, virtual, backward))
        key = (self.batch_key, mb, virtual, backward)
        if key not in self.shapes:
            header = np.zeros(HEADER, np.int64)
            self.wait([self.comm.irecv(header, source, self.tag(mb, virtual, backward, 0))], source)
            self.shapes[key] = (int(header[0]), tuple(int(d) for d in header[2:2 + int(header[1])]))
        self.post(source, mb, virtual, backward, xp)
        request, buf = self.posted.pop(key)
        self.wait([request], source)
        return buf

    def wait(self, requests, source):
        self.comm.wait_all(requests, f"recv from rank {source}", poll=self.poll)

    def wait_for_sends(self):
        self.comm.wait_all([r for r, _ in self.sends], "pipeline sends", poll=self.poll)
        self.sends = []

"""The guard around a Communicator: header checks, flight records, stall reports, trace spans.

As PyTorch checks collectives in ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL), around a
process group that stays plain, Guard fills the hooks of the core's seam (seam.py) from outside:
every collective, and every point-to-point call outside one, leaves a flight record
(flight_recorder.py; the death watch mirrors it, death_watch.py); with check_collectives each
collective first compares its header with the ring neighbour's (headers.py: p small messages); a
wait past comm_timeout compares every rank's records and ends the job or warns (reports.py); a
receive that does not fit names what the sender called. Cost: ~2 us per call for the record.
wrap(comm) puts it on; comm.init, ThreadWorld and every backend do unless told guard=False.
"""
import time

from .. import trace
from .flight_recorder import FlightRecorder, dtype_name
from .headers import check_header
from .reports import sender_note, stalled
from .seam import Unguarded


def wrap(comm, recorder=None, check_collectives=True, guard=True):
    """Put a Guard around ``comm``: its hooks, its flight recorder (``comm.recorder``, shared by every
    communicator of the rank) and the switch ``comm.check_collectives``. Returns ``comm`` (as it
    is when ``guard`` is False: the backends pass their keywords through)."""
    if not guard:
        return comm
    comm.recorder = FlightRecorder(comm.world_rank) if recorder is None else recorder
    comm.check_collectives = bool(check_collectives)
    comm.guard = Guard()
    return comm


class Guard(Unguarded):
    def options(self, comm):
        return {"check_collectives": comm.check_collectives, "recorder": comm.recorder}

    def opened(self, comm, name, seq, header, nbytes, async_op):
        """The collective's flight record: queued (async) or running from now."""
        shape, dtype = header.get("shape"), header.get("dtype")
        return comm.recorder.open(comm.uid, seq, name, None if shape is None else tuple(shape),
                                  None if dtype is None else dtype_name(dtype), nbytes, header.get("op"),
                                  header.get("extra"), state="queued" if async_op else "running")

    def run(self, comm, record, nbytes, body):
        """Check the header (check_collectives), run, close the record; a trace span around it."""
        if record.state == "queued":
            comm.recorder.run(record)
        tracing = trace.tracer().enabled
        start = time.perf_counter() if tracing else 0.0
        try:
            if comm.check_collectives and comm.size > 1:
                check_header(comm, record)
            result = body()
        except BaseException:
            comm.recorder.close(record, "failed")
            raise
        finally:
            if tracing:
                trace.tracer().add(record.name, "comm", start, time.perf_counter(), {"bytes": nbytes, "seq": record.seq})
        comm.recorder.close(record)
        return result

    def posted(self, comm, request, kind):
        buf = request.buf
        request.record = comm.recorder.open(comm.uid, -1, kind, tuple(buf.shape), dtype_name(buf.dtype), buf.nbytes,
                                            peer=comm.members[request.peer], tag=request.tag)

    def closed(self, comm, request, state):
        if request.record is not None:
            comm.recorder.close(request.record, state)
            request.record = None

    def waiting(self, comm, pending, start):
        """A long wait: tell the flight records on whom (the collective's, or each p2p call's)."""
        peers = sorted({comm.members[r.peer] for r in pending})
        call = comm._call()
        records = [call] if call is not None else [r.record for r in pending if r.record is not None]
        for record in records:
            record.waiting_for, record.wait_since = peers, start
        return records

    def stalled(self, comm, pending, what, elapsed, hard):
        stalled(comm, pending, what, elapsed, hard)

    def waited(self, marked):
        for record in marked:
            record.waiting_for = None

    def size_note(self, comm, request, call):
        return sender_note(comm, request, call)

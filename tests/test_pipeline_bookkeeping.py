"""The pipeline's messages keep the communicator's bookkeeping, done once instead of per message:
every byte handed to the transport is counted (at the step's end), a message waited for has a
flight record (so a stall names it as for irecv), and a message already there costs no record."""
import time

import numpy as np

import minitrain as mt
from minitrain.comm import CommError, ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel.pipeline import PipelineParallel
from minitrain.parallel.pipeline.messages import StageMessages
from test_flight_recorder import run_failing
from test_pipeline import batches, make_model


def test_each_step_counts_every_byte_the_transport_moved_point_to_point():
    def fn(comm):
        mt.set_default_dtype(np.float64)
        pipe = PipelineParallel(make_model(), comm, "1f1b", 4)
        moved = {"send": 0, "recv": 0}
        for kind, primitive in (("send", comm._isend), ("recv", comm._irecv)):
            def spy(buf, peer, tag, kind=kind, primitive=primitive):
                if comm._call() is None:                 # outside a collective: the pipeline's own
                    moved[kind] += buf.nbytes
                return primitive(buf, peer, tag)
            setattr(comm, "_" + ("isend" if kind == "send" else "irecv"), spy)
        seen = []
        for x, y in batches(3):
            pipe.train_step(x, y, F.cross_entropy)
            counted = comm.stats["p2p"]
            seen.append((counted["bytes_sent"], counted["bytes_received"], moved["send"], moved["recv"],
                         counted["messages_sent"]))
        return seen
    for seen in ThreadWorld(2).run(fn):
        for sent, received, moved_out, moved_in, messages in seen:
            assert (sent, received) == (moved_out, moved_in) and sent > 0 and received > 0
        assert seen[0][4] == 8 and seen[1][4] - seen[0][4] == 4     # 4 headers, then only the 4 arrays


def _two_steps(comm, late):
    """Rank 0 sends micro-batches 0 and 1 to rank 1 twice (the first step learns the shapes); in the
    second, micro-batch 1 leaves ``late`` s after micro-batch 0. Rank 1 returns its flight records
    before and after each receive of the second step, and the array tag of micro-batch 1."""
    messages, counts = StageMessages(comm, 2, 1), []
    for step in range(2):
        messages.begin("batch")
        if comm.rank == 0:
            for mb in range(2):
                if step == 1 and mb == 1:
                    time.sleep(late)
                messages.send(np.full((3, 4), float(mb)), 1, mb, 1, False)
            messages.wait_for_sends()
            continue
        counts = []
        if step == 1:
            time.sleep(0.1)                              # micro-batch 0 is there before it is asked for
        for mb in range(2):
            counts.append(len(comm.recorder.records))
            assert (messages.recv(0, mb, 1, False, np) == mb).all()
        counts.append(len(comm.recorder.records))
        messages.wait_for_sends()
    return counts, list(comm.recorder.records)[-1], messages.tag(1, 1, False, 1)


def test_a_message_waited_for_gets_a_flight_record_and_one_already_there_none():
    counts, last, tag = ThreadWorld(2).run(lambda comm: _two_steps(comm, late=0.3))[1]
    assert counts[1] == counts[0]                        # there already: tested once, no record
    assert counts[2] == counts[1] + 1                    # waited for: recorded, closed done
    assert (last.name, last.peer, last.tag, last.state) == ("recv", 0, tag, "done")


def test_a_pipeline_receive_that_never_comes_is_named_by_the_stall_report():
    def fn(comm):
        messages = StageMessages(comm, 2, 1)
        messages.begin("batch")
        if comm.rank == 0:
            messages.send(np.ones(4), 1, 0, 1, False)
            messages.wait_for_sends()
            messages.begin("batch")
            time.sleep(5)                                # never sends micro-batch 0 of this step
            return
        messages.recv(0, 0, 1, False, np)
        messages.begin("batch")
        messages.recv(0, 0, 1, False, np)
    text = run_failing(ThreadWorld(2, comm_timeout=0.2, timeout=0.6), fn, CommError)
    assert "recv from rank 0" in text and "tag" in text, text

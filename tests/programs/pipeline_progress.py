"""The pipeline's progress thread under real MPI (run by tests/test_pipeline_progress.py; argv[1]:
"thread" or "none", the forced choice). Prints what MPI answered when asked whether a message moves
without its sender, whether a message sent just before a compute reached its waiting receiver during
that compute, a pipeline step with the forced choice (the thread's polls and the gradients), the thread's
polls in nine steps, and whether the pipeline's thread ends once the pipeline is gone."""
import gc
import sys
import time

import numpy as np

import minitrain as mt
from minitrain import nn
from minitrain.comm import init
from minitrain.parallel.pipeline import PipelineParallel
from minitrain.parallel.pipeline.messages import StageMessages
from minitrain.parallel.pipeline.progress import PROBE_BYTES, ComputeProgress

COMPUTE_S = 0.5
MORE_STEPS = 8
comm = init(timeout=60)
thread = sys.argv[1] == "thread"
asked = ComputeProgress(comm)
print(f"rank {comm.rank}: moves without its sender {asked.probed}, thread {asked.enabled}", flush=True)

forced = ComputeProgress(comm, progress_thread=thread)
messages = StageMessages(comm, 2, 1)
messages.begin(None)
comm.barrier()
if comm.rank == 0:
    messages.send(np.ones(PROBE_BYTES // 8), 1, 0, 1, False)
    forced.around(lambda action, received: time.sleep(COMPUTE_S), messages)(None, None)   # outside MPI, no GIL
    left = time.monotonic()                # one clock for every process on this machine
    messages.wait_for_sends()
    comm.send(np.array([left]), 1, 8)
elif comm.rank == 1:
    buf = messages.recv(0, 0, 1, False, np)
    arrived = time.monotonic()
    left = np.zeros(1)
    comm.recv(left, 0, 8)
    assert (buf == 1).all()
    print(f"rank 1: arrived {'during' if arrived < left[0] else 'after'} the sender's compute", flush=True)

mt.set_default_dtype(np.float64)
mt.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))
pipe = PipelineParallel(model, comm, "1f1b", num_microbatches=2, progress_thread=thread)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((256, 32)), rng.integers(0, 4, 256)
loss = pipe.train_step(x, y, nn.functional.cross_entropy)
digest = sum(float(np.abs(q.grad).sum()) for q in pipe.parameters())
print(f"rank {comm.rank}: step loss {loss:.17g} grads {digest:.17g} polls {pipe.progress.polls}", flush=True)
for _ in range(MORE_STEPS):                # a poll needs the thread on a core within a compute of ~1 ms: on a
    pipe.train_step(x, y, nn.functional.cross_entropy)   # loaded machine one step may see none, nine do
print(f"rank {comm.rank}: polls in {1 + MORE_STEPS} steps {pipe.progress.polls}", flush=True)

thread_of_the_pipeline = pipe.progress.thread
del pipe
gc.collect()
if thread_of_the_pipeline is not None:
    thread_of_the_pipeline.join(10)
    print(f"rank {comm.rank}: thread ended with its pipeline {not thread_of_the_pipeline.is_alive()}", flush=True)

"""Injected faults under real MPI (run by tests/test_faults.py through mpiexec), written against the
public API only. Every rank runs a few "training steps" (an all-reduce of a gradient, a broadcast of
a flag); in step 2 rank 1 misbehaves:

  skip        skips the step's all-reduce (its next call is the broadcast: a different call)
  skip_last   skips the last all-reduce and leaves the script
  other       calls a broadcast where the others all-reduce
  shape       all-reduces 1001 elements where the others pass 1000
  raise       raises ValueError
  kill        is killed with SIGKILL
  sleep       sleeps for an hour (computing, as far as anyone can tell)
  ddp_shape   (DistributedDataParallel) holds a model of another shape
  async       no fault: asynchronous collectives in flight beside blocking ones
  ok          no fault

usage: comm_faults.py FAULT [--comm-timeout S] [--no-check]
"""
import argparse
import os
import signal
import time

import numpy as np

from minitrain.comm import all_reduce, broadcast, init, ring_all_reduce

parser = argparse.ArgumentParser()
parser.add_argument("fault")
parser.add_argument("--comm-timeout", type=float, default=10.0)
parser.add_argument("--no-check", action="store_true")
args = parser.parse_args()
comm = init(comm_timeout=args.comm_timeout, check_collectives=not args.no_check)
faulty = comm.rank == 1
print(f"rank {comm.rank} ready", flush=True)


def step(i):
    grad = np.full(1000, float(comm.rank + i), np.float32)
    if faulty and i == 2 and args.fault not in ("ok", "skip_last"):
        print(f"rank 1 injects {args.fault} at {time.time():.3f}", flush=True)
    if faulty and i == 2:
        if args.fault == "skip":
            pass
        elif args.fault == "other":
            broadcast(comm, grad, root=0)
        elif args.fault == "shape":
            all_reduce(comm, np.ones(1001, np.float32))
        elif args.fault == "raise":
            raise ValueError("injected failure in step 2")
        elif args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.fault == "sleep":
            time.sleep(3600)
        else:
            all_reduce(comm, grad)
    elif faulty and args.fault == "skip_last" and i == 3:
        print(f"rank 1 injects {args.fault} at {time.time():.3f}", flush=True)
        return
    else:
        total = all_reduce(comm, grad)
        assert total[0] == sum(r + i for r in range(comm.size)), f"rank {comm.rank} step {i}: {total[0]}"
    flag = np.array([i], np.int64)
    broadcast(comm, flag, root=0)


if args.fault == "async":
    x = np.ones(1000, np.float32)
    works = [all_reduce(comm, x * (i + 1), async_op=True) for i in range(5)]
    middle = ring_all_reduce(comm, x)            # a blocking collective while async ones are in flight
    results = [w.wait() for w in works]
    assert all(np.all(r == comm.size * (i + 1)) for i, r in enumerate(results)), "async results"
    assert np.all(middle == comm.size)
elif args.fault == "ddp_shape":
    from minitrain import nn
    from minitrain.parallel import DistributedDataParallel
    model = nn.Linear(4 + faulty, 3)
    if faulty:
        print(f"rank 1 injects {args.fault} at {time.time():.3f}", flush=True)
    DistributedDataParallel(model, comm)
else:
    for i in range(4):
        step(i)
        if args.fault == "skip_last" and faulty and i == 3:
            break
print(f"rank {comm.rank} done", flush=True)

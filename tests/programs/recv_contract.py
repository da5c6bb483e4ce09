"""The receive contract under real MPI (run by tests/test_faults.py with mpiexec -n 2): rank 0 sends,
rank 1 receives into a buffer of another size or dtype; each receive must raise CommError naming
both ranks, the tag and both sizes (the dtype case at the stall threshold, from the flight records).
Rank 1 prints each error as ``CASE name: message`` and the job goes on, then exits 0 (MPI_Finalize
with a message nobody received is not clean: MPICH's launcher then kills the job). At the end rank 1
computes 4 s longer than rank 0, which leaves after the hard timeout (3 s), saying so."""
import os
import time

import numpy as np

from minitrain.comm import CommError, init


def _cmdline_has(pid, *parts):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    return all(p in text for p in parts)


comm = init(comm_timeout=1.0)
comm = init(comm_timeout=1.0)        # a job may call init() again (the tests run jobs' main() in turn)
if comm.rank == 0:                   # ... and still has one death watch, not one per init()
    watchers = [d for d in os.listdir("/proc") if d.isdigit() and _cmdline_has(d, "death_watch.py", f":{os.getpid()}:")]
    print(f"death watchers of rank 0: {len(watchers)}", flush=True)
CASES = [("shorter", np.ones(3), np.empty(4), 5),                      # MPI itself would accept this
         ("longer", np.ones(5), np.empty(4), 6),                       # MPI truncates (an error class)
         ("dtype", np.ones(4, np.float32), np.empty(2, np.float64), 7)]  # same bytes: tags keep them apart
for name, sent, buf, tag in CASES:
    if comm.rank == 0:
        comm.send(sent, 1, tag=tag)
        if name == "dtype":
            time.sleep(3)       # computing: rank 1, the only rank waiting, reports its receive at 1 s
    else:
        start = time.monotonic()
        try:
            comm.recv(buf, 0, tag=tag)
            print(f"CASE {name}: accepted {buf}", flush=True)
        except CommError as e:
            message = " ".join(str(e).split())
            print(f"CASE {name} ({time.monotonic() - start:.1f} s): {type(e).__name__}: {message}", flush=True)
            if name == "dtype":      # the refused receive was withdrawn; the message is still there:
                comm.recv(np.empty(4, np.float32), 0, tag=7)     # a program that goes on takes it as sent
    comm.barrier()
print(f"rank {comm.rank} done", flush=True)
if comm.rank == 1:
    time.sleep(4)       # still computing when rank 0 leaves: rank 0 waits for it at exit 3 s at most

"""Exercise: the ring all-reduce (Patarasuk & Yuan 2009), the algorithm behind DDP and NCCL.

Write ``ring_all_reduce(comm, x, op="sum")`` with only point-to-point calls:
    comm.rank, comm.size
    comm.sendrecv(sendbuf, dest, recvbuf, source)   # send to dest and receive from source at once
    comm.send(buf, dest) / comm.recv(buf, source)   # buffers: contiguous numpy arrays
Return a NEW array, the same shape and dtype as x, holding the reduction over all ranks
(op is "sum", "mean", "max" or "min"; "mean" only for floating dtypes). Leave x untouched.
Any length must work: 0, 1, fewer elements than ranks, lengths not divisible by the ranks.

The plan (p ranks, x split into p chunks as np.array_split does):
  1. reduce-scatter: p-1 steps; at step s, send chunk (r - s - 1) % p to rank r+1 and receive
     chunk (r - s - 2) % p from rank r-1, combining it with your own copy of that chunk.
     Afterwards rank r holds the full reduction of chunk r.
  2. all-gather: p-1 steps; at step s, send chunk (r - s) % p to rank r+1 and receive chunk
     (r - s - 1) % p from rank r-1 (no combining: just copy).
Cost: each rank sends 2(p-1)/p·N elements, whatever p is: that is why it scales.

Check it:  python -m minitrain.exercises check ring_all_reduce path/to/this_file.py
"""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    p, r = comm.size, comm.rank
    flat = np.ascontiguousarray(x).reshape(-1)
    chunks = np.array_split(np.arange(flat.size), p)      # indices of each rank's chunk
    # EXERCISE: implement the reduce-scatter and the all-gather described above.
    raise NotImplementedError("ring_all_reduce: write the reduce-scatter and the all-gather")

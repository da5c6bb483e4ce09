"""torch.distributed's call shapes over minitrain's collectives: a PyTorch script's communication, unchanged.

    import minitrain.distributed as dist          # instead of: import torch.distributed as dist
    dist.init_process_group("gloo")               # mpiexec -n 4 python script.py (MPI is the launcher)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)      # t: a NumPy / CuPy array or a minitrain Tensor, in place

Each call is one of comm/'s hand-written collectives (the ring, the binomial tree, all_to_all_single),
with PyTorch's conventions laid over it (torch.distributed's documentation, "Collective functions"):
results are written into the caller's tensors; src / dst are global ranks (group_src /
group_dst: ranks within the group); async_op=True returns a Work whose wait() finishes the call;
a rank not in the group returns at once, as PyTorch's does (a warning says so). new_group(ranks)
is collective over the world, its ranks sorted unless sort_ranks=False. What the rings cost: comm/collectives.py.
gather and scatter go through all_gather and broadcast (every rank moves what the root would).
all_gather_object, gather_object and broadcast_object_list pickle, as PyTorch's do (objects.py).
batch_isend_irecv([P2POp(dist.isend, t, peer), P2POp(dist.irecv, u, peer2), ...]) posts every message before
any is waited on, so a ring exchange cannot deadlock at any p (p2p.py). monitored_barrier(timeout=...) names
the ranks that did not arrive in time, on rank 0 in PyTorch's words and on the others too (monitor.py).
new_subgroups(group_size) splits a group into groups of consecutive ranks, group_size None: the ranks on
each node (PyTorch's: its GPUs), checked to be the same on every rank; a rank outside the group takes part
(PyTorch's raises there, leaving the others waiting).
Backends: "mpi" and "gloo" (the same: MPI point-to-point), "nccl" (comm/nccl.py); the rendezvous is
the MPI launcher's, so init_method is "env://" or None and world_size / rank, where given, are checked
against it. timeout: how long any wait may last (the stall report comes at a third of it, at most 10 s).
Unlike PyTorch's gloo (checked call by call against torch 2.13): recv needs its src (no receive from any
source); ReduceOp.BAND / BOR / BXOR are refused (NCCL has none; on bool, MIN is and, MAX is or); an output of
any shape with p times the input's elements serves all_gather_into_tensor, as under NCCL; reduce leaves the
other ranks' tensors as they were (PyTorch: undefined); strided tensors, and an output that is the input,
give the right answer in every collective (gloo's can be wrong); a non-member's send / recv returns at once
(PyTorch's raises), its group questions (get_process_group_ranks, ...) are refused; a mismatch across ranks
(shape, dtype, op, root, call) raises on every rank, naming them, within the stall report's time; such
a report names the collective underneath (all_reduce: ring_ or recursive_doubling_all_reduce; all_gather,
all_gather_into_tensor, gather: ring_all_gather; scatter: broadcast). A refused argument is a ValueError or
TypeError where gloo raises RuntimeError; isend / irecv's wait() takes no timeout (the group's bounds it).
In a batch, a message to oneself is a copy (gloo's fails; NCCL's works); a non-member's batch returns []
(PyTorch's P2POp fails there); an empty batch is a ValueError (PyTorch's: IndexError). monitored_barrier
works on every backend (PyTorch's: gloo only), and its ranks other than 0 wait for rank 0 at most the
timeout plus the group's (PyTorch's: the group's timeout, then a broken connection once rank 0 has raised).
"""
from .collectives import (all_gather, all_gather_into_tensor, all_reduce, all_to_all, all_to_all_single, barrier,
                          broadcast, gather, reduce, reduce_scatter, reduce_scatter_tensor, scatter)
from .groups import (GroupMember, ProcessGroup, ReduceOp, destroy_process_group, get_backend, get_global_rank,
                     get_group_rank, get_process_group_ranks, get_rank, get_world_size, group, init_process_group,
                     is_available, is_initialized, new_group, new_subgroups, new_subgroups_by_enumeration)
from .monitor import monitored_barrier
from .objects import all_gather_object, broadcast_object_list, gather_object
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send

__all__ = ["GroupMember", "P2POp", "ProcessGroup", "ReduceOp", "all_gather", "all_gather_into_tensor",
           "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
           "broadcast", "broadcast_object_list", "destroy_process_group", "gather", "gather_object", "get_backend",
           "get_global_rank", "get_group_rank", "get_process_group_ranks", "get_rank", "get_world_size", "group",
           "init_process_group", "irecv", "is_available", "is_initialized", "isend", "monitored_barrier",
           "new_group", "new_subgroups", "new_subgroups_by_enumeration", "recv", "reduce", "reduce_scatter",
           "reduce_scatter_tensor", "scatter", "send"]

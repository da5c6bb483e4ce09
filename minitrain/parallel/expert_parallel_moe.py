"""An MoE layer whose experts are sharded over the ranks of an expert-parallel group (GShard, Lepikhin et
al. 2021; Switch, Fedus et al. 2022; Megatron-Core's all-to-all token dispatcher).

With ep ranks and E experts, rank r of the group holds experts r·E/ep .. (r+1)·E/ep - 1. Each rank
routes its own tokens exactly as nn.MoE does (router, top-k, capacity per group, the balancing loss:
all local), and dispatch() lays the kept rows out expert by expert, counts[e] rows for expert e, so
the rows for rank j are one contiguous block. Then:

1. counts exchanged: an equal-block all_to_all of the (ep, E/ep) count table, so rank r learns how
   many rows each rank sends to each of its experts (E/ep integers from every rank);
2. dispatch: AllToAll (expert_parallel.py) sends each block to its rank; the rows arrive source by
   source, expert by expert within a source, and are regrouped expert by expert;
3. each local expert runs once on all its rows (from every rank of the group);
4. combine: the outputs go back to the source order and through the reverse AllToAll, so each rank
   gets its own rows back in the order dispatch() made them; nn.MoE's combine gates and sums them.

Backward needs nothing more: each AllToAll sends the gradient back along its reversed splits. An expert's
gradient is then the sum over the tokens of every rank of the group, which is why its data-parallel
averaging differs from the dense parameters' (expert_data_parallel.py).
"""
from collections import OrderedDict

import numpy as np

from ..autograd import cat
from ..backend import array_module, to_host
from ..comm import all_to_all, ring_all_gather
from ..nn.layers import ModuleList
from ..nn.module import Module
from ..nn.moe import MoE
from .expert_parallel import AllToAll, all_to_all_bytes


def expert_range(num_experts, comm):
    """The experts rank ``comm.rank`` holds: a range of num_experts / comm.size consecutive ones."""
    per = num_experts // comm.size
    return range(comm.rank * per, (comm.rank + 1) * per)


class ExpertParallelMoE(MoE):
    """``moe``'s router and its experts ``expert_range(E, comm)``, the others left out; the same forward as
    nn.MoE but for run_experts. ``all_to_all_bytes_formula``: what the all-to-alls of the forwards so far
    send from this rank, forward and backward, computed from their split sizes; ``rows_routed`` and
    ``rows_taken`` (nn.MoE's): this rank's routed choices and the rows its experts took from every rank, in
    the forwards so far (the job resets them)."""

    def __init__(self, moe, comm):
        Module.__init__(self)
        E = moe.num_experts
        if E % comm.size:
            raise ValueError(f"expert parallelism: {E} experts do not split evenly over {comm.size} ranks")
        for name in ("num_experts", "top_k", "groups", "capacity_factor", "aux_loss_coef", "normalize_gates",
                     "aux_loss_scale"):
            setattr(self, name, getattr(moe, name))
        self.comm, self.first_expert = comm, expert_range(E, comm).start
        self.router = moe.router
        self.experts = ModuleList([moe.experts[e] for e in expert_range(E, comm)])
        self.aux_loss, self.stats, self.all_to_all_bytes_formula = None, None, 0
        self.rows_routed = self.rows_taken = 0

    def split_sizes(self, counts):
        """(send, receive, table): rows to each rank, rows from each rank, and table[i, l], the rows rank i
        sends to this rank's l-th expert (one equal-block all_to_all of the count table)."""
        P, L = self.comm.size, len(self.experts)
        mine = np.asarray(counts, np.int64).reshape(P, L)      # row j: my rows for rank j's experts
        table = all_to_all(self.comm, mine)
        return mine.sum(axis=1).tolist(), table.sum(axis=1).tolist(), table

    def run_experts(self, rows, counts):
        comm, L = self.comm, len(self.experts)
        send, receive, table = self.split_sizes(counts)
        self.all_to_all_bytes_formula += all_to_all_bytes(send, receive, comm.rank,
                                                          rows.shape[1] * rows.data.itemsize, rows.requires_grad)
        self.rows_taken += sum(receive)
        received = AllToAll.apply(rows, comm, receive, send)     # source-major, then expert
        if not sum(receive):    # no row here: the (0, C) rows carry the graph, so this rank joins both backwards
            return AllToAll.apply(received, comm, send, receive)
        xp, order = array_module(rows.data), source_to_expert_order(table)
        if L > 1:
            received = received[xp.asarray(order)]
        per_expert = table.sum(axis=0).tolist()
        outputs = [expert(piece) for expert, piece, n in zip(self.experts, received.split(per_expert, axis=0),
                                                             per_expert) if n]
        y = cat(outputs, axis=0) if len(outputs) > 1 else outputs[0]
        if L > 1:
            y = y[xp.asarray(np.argsort(order))]                      # back to source-major
        return AllToAll.apply(y, comm, send, receive)

    def extra_repr(self):
        return (super().extra_repr() + f", experts {self.first_expert}..{self.first_expert + len(self.experts) - 1} "
                f"of ep={self.comm.size}")


def source_to_expert_order(table):
    """The permutation that regroups rows laid out source by source (table[i, l] rows of rank i for
    expert l, expert by expert within each source) expert by expert, sources in rank order within each."""
    P, L = table.shape
    start = (np.cumsum(table.reshape(-1)) - table.reshape(-1)).reshape(P, L)
    pieces = [np.arange(start[i, l], start[i, l] + table[i, l]) for l in range(L) for i in range(P)]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)


def shard_experts(model, comm):
    """Replace every MoE layer of ``model`` (a GPT built whole, as one process builds it) by an
    ExpertParallelMoE over ``comm``: this rank keeps its E/ep experts. Returns the new layers."""
    layers = []
    for block in model.h:
        if isinstance(block.mlp, MoE):
            block.mlp = ExpertParallelMoE(block.mlp, comm)
            layers.append(block.mlp)
    return layers


def full_state_dict(model, comm):
    """Every parameter of the whole model (every expert), on every rank of ``comm`` (the expert-parallel
    group): each rank's experts all-gathered, keyed as one process names them (experts.<global index>)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]
    state = OrderedDict((name, to_host(value)) for name, value in model.state_dict().items()
                        if not any(name.startswith(f"{prefix}.experts.") for prefix, _ in layers))
    pieces = [(prefix, len(m.experts), l, name, p) for prefix, m in layers for l, e in enumerate(m.experts)
              for name, p in e.named_parameters()]
    if not pieces:
        return state
    flat = np.concatenate([to_host(p.data).reshape(-1) for *_, p in pieces])
    every = ring_all_gather(comm, flat, total=flat.size * comm.size).reshape(comm.size, -1)
    for rank in range(comm.size):                # rank's l-th expert of a layer is expert rank·per + l
        at = 0
        for prefix, per, l, name, p in pieces:
            state[f"{prefix}.experts.{rank * per + l}.{name}"] = every[rank, at:at + p.size].reshape(p.shape)
            at += p.size
    return state

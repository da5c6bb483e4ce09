"""What the GPT job on several ranks (gpt_parallel.py) reports beside its losses and bytes: the model
states a rank's layout expects (ZeRO's, parallel/zero_3d.py) and the JSON's "zero_memory" block, what
the pipeline's bubble figure assumes, the "cp" block (context parallelism's bytes per step beside
the formula, the attention work of the first rank with blocks' cp ranks), and the hooks that measure a block's bytes."""
import numpy as np

import minitrain
from minitrain.parallel.context_parallel.gpt import METHODS, cp_bytes_formula


MODEL_STATES = ("params", "grads", "optimizer_state")


def expected_model_states(model):
    """This rank's model states between steps by its layout (bytes): ZeRO's (zero_3d.py), or the stage's
    parameters, their gradients and AdamW's two moments whole (16-bit parameters: the moments and master
    weights in fp32, 12 bytes per parameter)."""
    if model.zero is not None:
        return model.zero.expected_bytes()
    b = sum(q.data.nbytes for q in model.parameters())
    n = sum(q.data.size for q in model.parameters())
    return {"params": b, "grads": b, "optimizer_state": 12 * n if model.scaler is not None else 2 * b}


def zero_memory(stage, dp, table):
    """The JSON's "zero_memory": per rank, the model states expected by the layout beside the ledger's."""
    return {"stage": stage, "dp": dp,
            "expected": "ZeRO-s over dp, S = ceil(stage parameters / dp): params S·b at 3 (else padded whole), grads "
                        "S·b at 2 and 3, optimizer state 2·S·b (AdamW's two moments; fp16/bf16: 12·S, the moments and "
                        "master weights in fp32) at 1 to 3",
            "ranks": [{"rank": r, "expected": dict(zip(MODEL_STATES, map(int, v[12:15]))),
                       "measured": dict(zip(MODEL_STATES, map(int, v[2:5])))} for r, v in enumerate(table)]}


def bubble_costs(pipe):
    """What the bubble figure assumes: equal stages; for zb_h1 and zbv (no closed form) F = B = W per
    chunk, the costs the runtime's formula_bubble_fraction simulates by default."""
    return {"F": 1.0, "B": 1.0, "W": 1.0} if pipe.split_backward else None


def bubble_line(pipe):
    if pipe.split_backward:
        return (f"bubble {pipe.formula_bubble_fraction():.3f} simulated (no closed form) with equal stages and "
                f"F = B = W per chunk (forward, input-gradient and weight-gradient work)")
    return f"bubble by the formula {pipe.formula_bubble_fraction():.3f}"


#: what the attention cores send on the cp communicator: the ring's K/V blocks as point-to-point messages, Ulysses'
#: all-to-alls. The rest there is the experts' routing (context_parallel/moe.py: each MoE layer's all-reduce of
#: its balancing counts, with a capacity an all-gather of the choices), which the attention formula leaves out.
ATTENTION_CALLS = ("p2p", "all_to_all_single", "all_to_all")


def cp_bytes_sent(comm):
    """[attention's, the experts' routing's] bytes this rank has sent so far on the cp communicator ``comm``."""
    attention = sum(entry["bytes_sent"] for name, entry in comm.stats.by_name.items() if name in ATTENTION_CALLS)
    return np.array([attention, comm.stats.bytes_sent - attention], np.float64)


def local_blocks(model):
    """The indices of the transformer blocks on this rank's pipeline stage(s)."""
    local = {id(q) for q in model.parameters()}
    return [i for i, b in enumerate(model.model.h) if any(id(q) in local for q in b.parameters())]


def measure_block_bytes(model):
    """Hooks around each block's forward that count what this rank sends on the tensor-parallel communicator
    (the list returned: one entry per block forward), Megatron's collectives alone: under sequence parallelism
    an MoE layer's routing (its counts and P summed, a capacity's choices gathered, on the tp ranks or cp x tp)
    is counted apart, in the dict's "bytes" (context_parallel/moe.py keeps it out of the attention's the same way)."""
    tp = model.mesh.comm("tp")
    token = [tp] + ([model.mesh.comm("cp_tp")] if model.cp > 1 and model.tp > 1 else [])
    layer_bytes, routing, before = [], {"bytes": 0.0, "in_block": False}, {}

    def block_starts(m, a):
        layer_bytes.append(-tp.stats.bytes_sent)
        routing["in_block"] = True

    def block_ends(m, a, o):
        layer_bytes[-1] += tp.stats.bytes_sent
        routing["in_block"] = False

    def routing_ends(m, a, o):     # moved out of its block's count (full recomputation reruns it alone)
        if routing["in_block"]:
            layer_bytes[-1] -= tp.stats.bytes_sent - before[id(tp)]
        routing["bytes"] += sum(c.stats.bytes_sent - before[id(c)] for c in token)

    for block in model.model.h:
        block.register_forward_pre_hook(block_starts)
        block.register_forward_hook(block_ends)
        if model.model.sequence_parallel and any(block.mlp is layer for layer in model.moe_layers):
            block.mlp.register_forward_pre_hook(lambda m, a: before.update((id(c), c.stats.bytes_sent) for c in token))
            block.mlp.register_forward_hook(routing_ends)
    return layer_bytes, routing


def layer_bytes_formula(model, args):
    """Megatron's bytes one block's forward sends on this rank's tensor-parallel communicator, as the job's hooks
    average them over this rank's blocks and its replica's micro-batches: 2 all-reduces (or RS + AG pairs), an
    MoE block 1 (its experts replicated), each 2(t-1)/t of a micro-batch's rows·(T/cp)·C; NaN without blocks."""
    blocks = local_blocks(model)
    if not blocks:
        return np.nan
    d, dp, tp = model.mesh.coordinate("dp"), model.dp, model.tp
    rows = args.batch_size // dp + (1 if d < args.batch_size % dp else 0)       # this replica's (GPT3D's cut)
    all_reduces = np.mean([1 if model.model.config.is_moe_layer(i) else 2 for i in blocks])
    itemsize = np.dtype(minitrain.get_default_dtype()).itemsize
    return (all_reduces * 2 * (tp - 1) / tp * rows / args.microbatches * (args.block_size // args.cp) * args.n_embd
            * itemsize)


def cp_report(model, args, table):
    """The JSON's "cp" block: the bytes the first rank with blocks (rank 0 but where zbv leaves stage 0 only the
    embedding and the head) sends on the cp communicator per step by attention, measured (table column 15) and
    from the sizes (its replica's rows, its stage's blocks: column 20); the attention work (score entries
    computed, column 16) of that rank's cp ranks, max over mean; with experts, what their routing sent there
    (column 17; under sequence parallelism it goes over the cp x tp ranks: measure_block_bytes counts it)."""
    first = int(np.flatnonzero(table[:, 20])[0])
    stage, d, _, t = (int(i) for i in np.argwhere(model.mesh.grid == first)[0])
    rows = args.batch_size // model.dp + (1 if d < args.batch_size % model.dp else 0)    # GPT3D's cut
    itemsize = np.dtype(minitrain.get_default_dtype()).itemsize
    formula = table[first, 20] * rows * cp_bytes_formula(args.cp_method, args.cp, args.block_size,
                                                         args.n_embd // args.tp, itemsize, args.recompute)
    work = table[model.mesh.grid[stage, d, :, t], 16] if args.cp > 1 else np.ones(1)
    return {"size": args.cp, "method": args.cp_method if args.cp > 1 else None, "layout": METHODS[args.cp_method]
            if args.cp > 1 else None, "bytes_from": f"rank {first}", "bytes_per_step": float(table[first, 15]),
            "bytes_formula": float(formula), "compute_max_over_mean": float(work.max() / work.mean()),
            **({"experts_bytes_per_step": float(table[first, 17])} if model.moe_layers and args.cp > 1
               and not args.sequence_parallel else {})}      # (with SP the routing is on cp x tp: counted apart)

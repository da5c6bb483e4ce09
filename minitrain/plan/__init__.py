"""The planner: will it fit, how fast, which layout — predicted from sizes, calibrated on the machine.

    python -m minitrain.plan gpt --n-layer 96 --n-embd 12288 --n-head 96 --block-size 2048 \\
        --vocab-size 51200 --batch-size 1536 --world 1024 --precision bf16 --machine a100 --search

Memory per rank by category (plan/memory.py: the papers' accounting and minitrain's own, the bytes
the jobs' ledger counts), step time from the work a step does counted from the code (plan/work.py:
matmuls, the library's ops, graph nodes), priced on the machine (plan/ops.py, plan/time.py:
calibrated matmul rates and op costs, alpha-beta communication, the pipeline schedule's simulated bubble),
machine constants measured by python -m minitrain.plan calibrate (plan/calibrate.py,
plan/overheads.py) and checked against the jobs by python -m minitrain.plan validate.
predict(model, layout) is the whole model; mlp_from_args / gpt_from_args turn a job's parsed
options (examples.mlp / examples.gpt) into a model and a layout, so a job can print the prediction beside
what it measured.
"""
import importlib

from ..parallel.pipeline.schedules import default_chunks
from .layout import Layout, LayoutError, check, layouts
from .models import GPT, MLP, Params

# Every rank of a job imports the planner's option rules at start-up (examples/options.py); only rank 0 asks
# for a prediction, at the end. So the predictions' modules load when first named (PEP 562): 30-40 ms of CPU
# less at every other rank's start-up (with its bytecode cached; measured.md).
_LAZY = {"predict_memory": "memory", "korthikanti_layer_bytes": "papers", "CATEGORIES": "states",
         "flops_per_iteration": "counts", "predict_time": "time", "MachineError": "calibrate",
         "load_machine": "calibrate"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    return value

DIGITS_FEATURES, DIGITS_CLASSES = 64, 10          # the mlp job's data: 8x8 digits, 10 classes
MLP_PIPELINE_PRECISIONS = ("fp32", "fp64")          # the mlp job's pipeline has no mixed precision


def predict(model, layout, machine=None, accounting="minitrain", device_memory=None, per_stage=True,
            time_if_unfit=True):
    """The planner's answer for one layout, as ``plan --json`` prints it: memory_bytes (of the rank that holds
    the most: each category at the moment of its peak, and that peak, their sum, as total), category_peaks
    (each category's own peak, at its own moment: they may sum to more than the total),
    step_time_s, step_busy_s (the CPU time of the step's own thread, which the
    jobs' step timer measures: plan/time.py), bubble_fraction (these three None for params: no step is timed),
    fits, flops_per_iteration, the layout.
    time_if_unfit=False (--search): a layout that does not fit is answered {'fits': False} alone."""
    from .calibrate import load_machine
    from .counts import flops_per_iteration
    from .memory import predict_memory
    from .activations import mlp_pieces
    from .states import CATEGORIES, offloaded_states
    from .time import predict_time
    check(model, layout)
    machine = machine if isinstance(machine, dict) else load_machine(machine)
    memory = predict_memory(model, layout, accounting)
    heaviest = memory["stages"][memory["heaviest"]]
    # --offload's host bytes (the mlp and params models: data parallelism alone, every rank alike; the MLP's
    # ZeRO-3 shards padded unit by unit, as its walk pads them)
    units = ([u for p in mlp_pieces(model, layout, layout.micro_batch_size) for u in p.units]
             if model.kind == "mlp" and layout.offload else None)
    host = offloaded_states(model.num_parameters(), layout, units) if layout.offload and model.kind != "gpt" else None
    need, shared = heaviest["total"], False
    capacity = device_memory if device_memory is not None else machine.get("device_memory_bytes")
    host_share = host_share_bytes(machine, layout.world)
    if capacity is None and host_share is not None:   # a CPU: the ranks' memory is the host's,
        capacity, shared = host_share, host is not None        # where the offloaded states live too
        need += host["total"] if shared else 0
    host_fits = host is None or shared or host_share is None or host["total"] <= host_share
    if not time_if_unfit and not (host_fits and (capacity is None or need <= capacity)):
        return {"fits": False}
    time = predict_time(model, layout, machine)
    timed = model.kind != "params"                # model states alone: no step, its figures null
    result = {"model": model.kind, "num_params": model.num_parameters(), "layout": layout.as_dict(),
              "describe": layout.describe(), "accounting": accounting, "machine": machine.get("name"),
              "memory_bytes": {**{c: heaviest[c] for c in CATEGORIES}, "total": heaviest["total"]},
              "category_peaks": heaviest["category_peaks"],
              "step_time_s": {k: time[k] for k in ("compute", "comm", "bubble", "total")} if timed else None,
              "step_busy_s": time["busy"] if timed else None,
              "bubble_fraction": time["bubble_fraction"] if timed else None,
              "host_memory_bytes": host, "fits_counts_host": shared,
              "host_capacity_bytes": host_share if host is not None else None,
              "fits": host_fits and (capacity is None or need <= capacity), "device_memory_bytes": capacity,
              "flops_per_iteration": flops_per_iteration(model, layout)}
    if per_stage:
        result["memory_bytes_per_stage"] = memory["stages"]
    return result


def host_share_bytes(machine, world):
    """Each rank's share of its host's memory (machine["memory_bytes"], one host's): on a CPU every rank is on the
    one host; on a GPU machine its gpus_per_node ranks share one (as DeepSpeed's estimators count a node's CPU
    memory). None where the machine does not say."""
    if machine.get("memory_bytes") is None:
        return None
    on_one = world if machine.get("device_memory_bytes") is None else min(world, machine.get("gpus_per_node", 1))
    return machine["memory_bytes"] // on_one


def mlp_from_args(args, world):
    """(model, layout) of ``python -m minitrain.examples.mlp`` with these options on ``world`` ranks."""
    pipeline = args.strategy == "pipeline"
    pp = max(1, world // args.dp) if pipeline else 1
    try:                                   # the job's defaults: zbv's 2 chunks, enough layers for every stage
        chunks = default_chunks(args.schedule, args.chunks) if pipeline else 1
    except ValueError as e:
        raise LayoutError(str(e)) from None
    layers = args.layers if args.layers is not None else (max(2, pp * chunks) if pipeline else 2)
    model = MLP(tuple([DIGITS_FEATURES] + [args.hidden] * layers + [DIGITS_CLASSES]))
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(args.strategy, 0)
    common = dict(world=world, batch_size=args.batch_size, precision=args.precision, optimizer=args.optimizer,
                  bucket_cap_mb=args.bucket_cap_mb, threads=getattr(args, "threads", 0) or 0)
    if pipeline:                           # the pipeline job: fp32/fp64, no offload, no recompute (it refuses them)
        for option, asked in (("--recompute", args.recompute != "none"), ("--offload", args.offload),
                              ("--offload-activations", args.offload_activations),
                              (f"--precision {args.precision}", args.precision not in MLP_PIPELINE_PRECISIONS)):
            if asked:
                raise LayoutError(f"{option} is not supported with --strategy pipeline (the job refuses it too)")
        return model, Layout(dp=args.dp, pp=pp, microbatches=args.microbatches,
                             chunks=chunks, schedule=args.schedule, **common)
    return model, Layout(dp=world, zero=stage, offload=args.offload, recompute=args.recompute,
                         offload_activations=args.offload_activations,
                         local_sgd_every=args.sync_every if args.strategy == "local_sgd" else 0, **common)


def runs_moe_on_dp(experts, world, dp, tp, pp, cp, microbatches, zero, ep, save_dir):
    """Whether the GPT job (examples/gpt.py, which asks this) trains its MoE GPT as nn.GPT itself under DDP
    (examples/gpt_moe.py) rather than as GPT3D: on more than one rank, without tp, pp, cp, micro-batches or
    ZeRO, and without checkpoints under ep (GPT3D saves the experts by their global names)."""
    return (bool(experts) and (world > 1 or dp > 1) and tp == pp == cp == microbatches == 1 and not zero
            and not (ep > 1 and save_dir))


def gpt_from_args(args, world, vocab_size):
    """(model, layout) of ``python -m minitrain.examples.gpt`` with these options on ``world`` ranks
    (zero / precision / optimizer: the planner's own options, with the job's defaults)."""
    tp, pp, cp, ep = args.tp, args.pp, getattr(args, "cp", 1) or 1, getattr(args, "ep", 1) or 1
    dp = args.dp if args.dp is not None else max(1, world // (tp * pp * cp))
    experts = getattr(args, "moe_experts", 0) or 0
    moe = {} if not experts else dict(
        moe_experts=experts, moe_top_k=args.moe_top_k, moe_every=args.moe_every,
        moe_capacity_factor=args.moe_capacity_factor, moe_groups=args.moe_groups or 0,
        expert_hidden=getattr(args, "expert_hidden", 0) or 0, moe_shared=getattr(args, "moe_shared", 0) or 0)
    model = GPT(vocab_size=vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                n_embd=args.n_embd, dropout=args.dropout, ffn_hidden=getattr(args, "ffn_hidden", 0) or 0, **moe)
    moe_dp = runs_moe_on_dp(experts, world, dp, tp, pp, cp, args.microbatches, getattr(args, "zero", 0), ep,
                            getattr(args, "save_dir", None))
    parallel = not moe_dp and (world > 1 or tp > 1 or pp > 1 or dp > 1 or args.microbatches > 1)
    layout = Layout(world=world, batch_size=args.batch_size, dp=dp, pp=pp, tp=tp, cp=cp, ep=ep,
                    moe_load=getattr(args, "moe_load", 1.0) or 1.0,
                    cp_method=getattr(args, "cp_method", "ring") or "ring",
                    zero=getattr(args, "zero", 0) or 0, sequence_parallel=args.sequence_parallel,
                    recompute=args.recompute, schedule=args.schedule, microbatches=args.microbatches,
                    chunks=args.chunks or (2 if args.schedule == "zbv" else 1), precision=getattr(args, "precision", "fp32") or "fp32",
                    optimizer="adamw", offload_activations=args.offload_activations, threads=getattr(args, "threads", 0) or 0,
                    extras={"parallel_job": parallel, "moe_dp_job": moe_dp})
    return model, layout


def corpus_vocab_size():
    """The gpt job's vocabulary: the characters of its corpus (Python's standard library sources)."""
    from ..data import load_text
    return load_text().vocab_size


__all__ = ["GPT", "MLP", "Params", "Layout", "LayoutError", "check", "layouts", "predict", "predict_memory",
           "predict_time", "flops_per_iteration", "korthikanti_layer_bytes", "load_machine", "MachineError",
           "mlp_from_args", "gpt_from_args", "corpus_vocab_size", "CATEGORIES"]

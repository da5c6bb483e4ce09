"""The GPT job on several ranks: mpirun -n N python -m minitrain.examples.gpt [--tp T] [--pp P]
[--dp D] [--sequence-parallel] [--schedule 1f1b|zb_h1|... --microbatches M --chunks V] [--dropout P]
[--recompute full|selective] [--offload-activations] [--zero 1|2|3] [--cp C --cp-method ring|ulysses]
[--moe-experts E [--ep N]].

The N ranks form a DeviceMesh of dp x pp x cp x tp (tp innermost; --dp defaults to N / (pp·cp·tp))
and train GPT3D: each stage of the pipeline is tensor-parallel over its tp ranks, each replica
takes its rows of the global batch. --tp N alone is Megatron's tensor parallelism, --pp N
alone a pipeline, no flag plain data parallelism; --zero shards each stage's optimizer state (1), gradients (2)
and parameters (3) over its dp replicas (parallel/zero_3d.py). Every rank draws the same global batches.
Rank 0 prints the loss, the bytes each rank sent per step and per transformer layer (measured with
hooks around each block's forward, on the tensor-parallel communicator) beside Megatron's count
(2 all-reduces of b·T·C forward for a micro-batch of b rows: 2 x 2(t-1)/t·b·T·C·bytes), the
pipeline's bubble by the formula (zb_h1, zbv: simulated at F = B = W, equal stages), memory per rank,
and a sample. The validation loss is Megatron's evaluate(): the forward alone through the same mesh
(GPT3D.eval_step), no rank holding the whole model; only the sample gathers it, on rank 0.
With --cp C the mesh is dp x pp x cp x tp: each rank holds block-size/C positions of every row
(parallel/context_parallel/), and the table and --json's "cp" block give the first rank with blocks' attention
bytes on the cp communicator per step (measured) beside the formula from the sizes (with experts, their routing's
bytes there beside), and the attention work of its cp ranks, max over mean (score entries each computed).
--save-dir/--resume: each rank saves its slices (GPT3D.sharded_parameters), and a checkpoint
resumes on any other mesh (or in one process). With --moe-experts (GPT3D: each MoE layer replicated on
its stage's tp ranks, capacity groups per micro-batch; with --sequence-parallel each tp rank routes its own
tokens, and "experts_sp_bytes_per_step" is what that routing sent, kept out of the bytes per layer beside
Megatron's count) the table and --json add the "moe" block, its
figures gathered from every stage, as one process given the same --moe-groups reports them. --ep N shards
each stage's experts over blocks of N dp replicas (parallel/expert_parallel_3d.py); "all_to_all_bytes_per_step"
is the busiest rank's mean over steps of what all_to_all_single sent on its ep communicator, beside
"all_to_all_bytes_formula" from the split sizes used (as the data-parallel MoE job reports them); with
--zero the experts have a ZeRO of their own over the dp replicas that hold the same experts. Checkpoints
save each expert under its global name, so --ep runs resume on any layout (with --zero too).
"""
import contextlib
import sys
import time

import numpy as np

import minitrain
from minitrain import comm as mtcomm
from minitrain import memory, nn, optim
from minitrain.checkpoint import CheckpointError
from minitrain.data import load_text
from minitrain.examples import checkpointing
from minitrain.examples.common import (PRECISIONS, checks_line, device_code, init_comm, mpi_line, part_of_job, tqdm,
                                       transport_name)
from minitrain.examples.gpt_common import (all_to_all_sent, all_to_all_step, all_to_all_summary, estimate_loss,
                                           gpt_config, grad_norms, layout, mixed_precision, moe_summary, nothing_left,
                                           routing_load, routing_step, print_sample, scheduler_for,
                                           stage_routing_loads)
from minitrain.examples.gpt_parallel_report import (MODEL_STATES, bubble_costs, bubble_line, cp_bytes_sent, cp_report,
                                                    expected_model_states, layer_bytes_formula, local_blocks,
                                                    measure_block_bytes, zero_memory)
from minitrain.examples.report import (StepWatch, device_name, fmt_bytes, gather_steps, plan_comparison,
                                       show_plan, write_json)
from minitrain.parallel import offload_activations
from minitrain.parallel.context_parallel.gpt import METHODS
from minitrain.parallel.gpt_3d import GPT3D
from minitrain.plan.layout import empty_microbatches


def main_parallel(args):
    comm = init_comm(args)
    world, rank = comm.size, comm.rank
    tp, pp, cp = args.tp, args.pp, args.cp
    cp_text = f" x --cp {cp}" if cp > 1 else ""
    if args.dp is None and world % (tp * pp * cp):
        if rank == 0:
            sys.stderr.write(f"error: --pp {pp}{cp_text} x --tp {tp} = {pp * cp * tp} ranks per replica do not divide "
                             f"this job's {world} ranks\n")
        return 2
    dp = args.dp if args.dp is not None else world // (tp * pp * cp)
    if dp * pp * cp * tp != world:
        if rank == 0:
            sys.stderr.write(f"error: --dp {dp} x --pp {pp}{cp_text} x --tp {tp} = {dp * pp * cp * tp} ranks, but this "
                             f"job has {world} (mpirun -n {dp * pp * cp * tp})\n")
        return 2
    empty = empty_microbatches(args.microbatches, args.batch_size, dp)
    if empty:
        if rank == 0:
            sys.stderr.write(f"error: {empty}\n")
        return 2
    minitrain.manual_seed(args.seed)
    corpus = load_text()
    config = gpt_config(args, corpus.vocab_size, dp)
    gpt = nn.GPT(config).to(PRECISIONS[args.precision])     # fp16 / bf16: GPT3D's optimizer keeps fp32 masters
    psi = gpt.num_parameters()
    rng = np.random.default_rng(args.seed)                   # the same batches on every rank
    try:
        model = GPT3D(gpt, comm, dp=dp, pp=pp, tp=tp, schedule=args.schedule, num_microbatches=args.microbatches,
                      chunks=args.chunks, sequence_parallel=args.sequence_parallel, zero=args.zero,
                      cp=cp, cp_method=args.cp_method, ep=args.ep)
    except (ValueError, mtcomm.MeshError) as e:
        if rank == 0:
            sys.stderr.write(f"error: {e}\n")
        return 2
    del gpt
    opt = model.optimizer(optim.AdamW, lr=args.lr, weight_decay=0.01,
                          **({"init_scale": args.init_scale} if args.precision == "fp16" else {}))
    scheduler = scheduler_for(opt, args)
    layer_bytes, sp_routing = measure_block_bytes(model)      # bytes sent inside each block's forward

    axes = [f"{name}{size}" for name, size in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)) if size > 1]
    strategy = "+".join(name[:2] for name in axes) or "single"
    strategy += "+sp" if args.sequence_parallel else ""
    strategy += f"+zero{args.zero}" if args.zero else ""
    strategy += f"+ep{args.ep}" if args.ep > 1 else ""
    ckpt = checkpointing.Checkpointer(args, comm, model, opt, scheduler,
                                      layout=layout(args, strategy, dp, pp, tp, world), **checkpointing.data_rng(rng))
    try:
        first_step = ckpt.start_step()
    except CheckpointError as e:
        return checkpointing.fail(comm, e)
    val_rng = np.random.default_rng(args.seed + 1)            # apart from rng; the same batches on every rank
    initial_val = estimate_loss(model, corpus, args, val_rng)      # the fresh or the resumed model's
    memory.reset_peak()
    losses, norms, moe, a2a, routing = [], [], [], [], []    # a2a: (measured, formula) all-to-all bytes per step
    ep_layers = [layer for layer in model.moe_layers if model.ep > 1]
    bar = tqdm(range(first_step, args.steps), disable=args.no_progress or rank != 0, file=sys.stdout,
               desc=" x ".join(axes) + (" + sp" if args.sequence_parallel else ""), unit="step")

    def bytes_sent():                                        # this rank's, on the world and the mesh's axes
        axes = ("dp", "pp", "tp") + (("cp", "dp_cp") if cp > 1 else ()) + (("cp_tp",) if cp > 1 and tp > 1 else ())
        return comm.stats.bytes_sent + sum(model.mesh.comm(a).stats.bytes_sent for a in axes) + sum(
            c.stats.bytes_sent for c in (model.ep_comm, model.expert_dp_comm) if c is not None)
    comm.barrier()
    sent_before = bytes_sent()
    cp_sent_before = cp_bytes_sent(model.mesh.comm("cp"))
    sp_routing["bytes"] = 0.0
    start = time.perf_counter()
    offload = offload_activations() if args.offload_activations else contextlib.nullcontext()
    watch = StepWatch()
    for step in bar:
        x, y = corpus.get_batch("train", args.batch_size, args.block_size, rng)
        layer_bytes.clear()
        a2a_before = all_to_all_sent(model.ep_comm)
        with watch.step():
            model.zero_grad()
            with offload:
                loss = model.train_step(x, y)
            norms.append(model.clip_grad_norm_(1.0))
            opt.step()
            scheduler.step()
        losses.append(loss)
        if model.moe_layers:
            moe.append(model.moe_statistics)
        a2a.append(all_to_all_step(model.ep_comm, ep_layers, a2a_before))   # this rank's stage's layers
        routing.append(routing_step(model.moe_layers))
        ckpt.after_step(step + 1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    ckpt.finish(first_step + len(losses))
    if not losses:
        return nothing_left(args, first_step, rank, world)
    steps = len(losses)
    sent_per_step = (bytes_sent() - sent_before) / steps
    cp_sent_per_step = (cp_bytes_sent(model.mesh.comm("cp")) - cp_sent_before) / steps     # attention's, the experts'
    cp_computed = sum(core.computed for core in model.cp_cores)
    peak, persistent = memory.peak(), watch.persistent
    row = np.array([sent_per_step, float(np.mean(layer_bytes)) if layer_bytes else np.nan,
                    *(persistent[c] for c in ("params", "grads", "optimizer_state")), peak["activations"],
                    peak["total"], *(peak[c] for c in memory.CATEGORIES), *expected_model_states(model).values(),
                    cp_sent_per_step[0], cp_computed, cp_sent_per_step[1], layer_bytes_formula(model, args),
                    sp_routing["bytes"] / steps, len(local_blocks(model)), mixed_precision(model.scaler).get(
                        "skipped_steps", 0), device_code()], np.float64)
    table = mtcomm.ring_all_gather(comm, row, total=row.size * world).reshape(world, -1)
    step_by_rank, slowest = gather_steps(comm, watch.timer)
    a2a_measured, a2a_formula, _, a2a_line = all_to_all_summary(comm, a2a, args.ep)
    load = routing_load(comm, routing, args.ep, per_layer=args.recompute == "full")
    stage_loads = stage_routing_loads(comm, routing, args.ep, model.mesh.coordinate("pp"), pp,
                                      per_layer=args.recompute == "full") if args.moe_experts else None
    final_val = estimate_loss(model, corpus, args, val_rng)
    state = model.full_state_dict() if args.sample_chars else None     # the sample alone needs the model whole
    cp_block = cp_report(model, args, table)
    if rank != 0:
        return 0
    full = None
    if state is not None:
        full = nn.GPT(config).to(PRECISIONS[args.precision])
        full.load_state_dict(state)
    B, T = args.batch_size, args.block_size
    b = -(-B // (dp * args.microbatches))                   # the largest micro-batch (they may differ by a row)
    measured_layer = table[~np.isnan(table[:, 1])][:, [1, 18, 19]]   # the first rank with blocks: measured, formula,
    routing = float(measured_layer[0, 2]) if len(measured_layer) else 0.0      # and its experts' routing under SP
    head, tail = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"GPT {psi:,} parameters on {model.mesh.describe().splitlines()[0]} [{minitrain.backend.describe_device()} on rank 0, "
          f"transport {transport_name(comm)}]"
          + (", sequence parallel" if args.sequence_parallel else ""))
    print(f"MPI: {mpi_line()}; {checks_line(args)}")
    if pp > 1:
        print(f"pipeline {args.schedule}, {args.microbatches} micro-batches of {b} rows"
              + (f", {args.chunks} chunks" if args.chunks > 1 else "") + ": " + bubble_line(model.pipe))
    if args.zero:
        print(f"ZeRO-{args.zero} over the {dp} dp replicas"
              + (f" (experts over their {dp // args.ep} expert data-parallel replicas)" if args.ep > 1 else "")
              + ": model states per rank between steps, expected / measured: "
              + ", ".join(f"{c} {fmt_bytes(e)} / {fmt_bytes(m)}" for c, e, m in zip(MODEL_STATES, table[0, 12:15],
                                                                                 table[0, 2:5])) + " (rank 0)")
    if cp > 1:
        print(f"context parallel: {cp} ranks, {args.cp_method} ({METHODS[args.cp_method]} layout); on the cp "
              f"communicator {cp_block['bytes_from']} sent {fmt_bytes(cp_block['bytes_per_step'])}/step for attention "
              f"(formula {fmt_bytes(cp_block['bytes_formula'])})"
              + (f" and {fmt_bytes(cp_block['experts_bytes_per_step'])}/step for the experts' routing"
                 if "experts_bytes_per_step" in cp_block else "")
              + f"; attention work max/mean over its cp ranks "
              f"{cp_block['compute_max_over_mean']:.3f}")
    print(f"dropout {args.dropout}, recompute: {args.recompute}"
          + (", activations offloaded" if args.offload_activations else ""))
    print(f"train loss {head:.3f} (first 10 steps) -> {tail:.3f} (last 10); val loss {initial_val:.3f} -> "
          f"{final_val:.3f}; {1 / slowest['step_time_s']:.1f} steps/s (steady state)")
    moe_block, moe_line = moe_summary(moe) if moe else (None, None)
    if moe_line:
        placed = ("replicated on the tp ranks" if args.ep == 1 else f"sharded over expert-parallel groups of "
                  f"{args.ep} dp replicas ({args.moe_experts // args.ep} per rank), replicated on the tp ranks")
        print(f"{args.moe_experts} experts per MoE layer, {placed}; --moe-groups {config.moe_groups}")
        print(moe_line)
        print(a2a_line)
    print(f"\n{'rank':>4} {'device':>7} {'sent/step':>10} {'fwd/layer':>10} {'formula':>10} {'params':>10} "
          f"{'grads':>10} {'optimizer':>10} {'peak act.':>10} {'peak':>10}")
    for r, v in enumerate(table):
        layer, formula = ("-", "-") if np.isnan(v[1]) else (fmt_bytes(v[1]), fmt_bytes(v[18]))
        print(f"{r:>4} {device_name(v[-1]):>7} {fmt_bytes(v[0]):>10} {layer:>10} {formula:>10} "
              + " ".join(f"{fmt_bytes(x):>10}" for x in v[2:7]))
    print("(fwd/layer: bytes sent on the tensor-parallel communicator inside one transformer block's forward\n"
          " for one micro-batch, the mean over its blocks and micro-batches; formula: Megatron's 2 all-reduces\n"
          " of b·T·C, 2 x 2(t-1)/t·b·T·C·bytes, with this replica's mean micro-batch of b rows and T/cp positions;\n"
          " backward sends the same again; '-': a stage without blocks"
          + ("; an MoE block sends 1 (its experts replicated), the formula averages over the blocks" if moe else "")
          + ("; with sequence parallelism the experts' routing is counted apart: the first rank with blocks sent "
             f"{fmt_bytes(routing)}/step for it" if moe and args.sequence_parallel else "") + ")")
    compared = plan_comparison(args, world, slowest, table[:, 6].max(), kind="gpt", vocab_size=config.vocab_size,
                               moe_load=load[0], moe_load_step=load[1], moe_load_per_stage=stage_loads)
    show_plan(args, compared)
    print_sample(full, config, corpus, args)
    if args.json:
        write_json(args.json, {
            "world_size": world, "mpi_library": mpi_line(), "comm_timeout": args.comm_timeout, "check_collectives": args.check_collectives, "strategy": strategy,
            "dp": dp, "pp": pp, "tp": tp, "zero": args.zero, "zero_memory": zero_memory(args.zero, dp, table),
            "cp_method": args.cp_method if cp > 1 else None, "cp": cp_block,
            "transport": transport_name(comm),
            "sequence_parallel": args.sequence_parallel, "schedule": args.schedule,
            "microbatches": args.microbatches, "chunks": args.chunks,
            "bubble_formula": model.pipe.formula_bubble_fraction(),
            "bubble_formula_costs": bubble_costs(model.pipe),
            "dropout": args.dropout, "recompute": args.recompute,
            "num_params": psi, "initial_val_loss": initial_val, "final_val_loss": final_val, "final_loss": float(tail),
            "steps_per_second": 1 / slowest["step_time_s"], "tokens_per_second": B * T / slowest["step_time_s"],
            "elapsed_seconds": elapsed, "planner": compared,
            "steady_state": watch.steady_state(),
            "precision": args.precision, **mixed_precision(model.scaler), "first_step": first_step, "losses": losses,
            "grad_norms": grad_norms(norms),
            **({"moe": moe_block, "all_to_all_bytes_per_step": a2a_measured, "all_to_all_bytes_formula": a2a_formula}
               if moe_block else {}),
            **({"experts_sp_bytes_per_step": routing} if moe_block and args.sequence_parallel else {}),
            "ep": args.ep, **slowest, "blas_threads": minitrain.backend.blas_threads(),
            "bytes_per_step": float(table[0, 0]),
            "bytes_per_layer_forward": float(measured_layer[0, 0]) if len(measured_layer) else None,
            "bytes_per_layer_forward_formula": float(measured_layer[0, 1]) if len(measured_layer) else None,
            "ranks": [{"rank": r, "device": device_name(v[-1]), "bytes_sent": float(v[0]) * steps,
                       "memory": {"persistent": dict(zip(("params", "grads", "optimizer_state"), map(int, v[2:5]))),
                                  "peak": {**dict(zip(memory.CATEGORIES, map(int, v[7:12]))), "total": int(v[6])}},
                       "step": step_by_rank[r], **({"skipped_steps": int(v[-2])} if model.scaler else {})}
                      for r, v in enumerate(table)]})
    return 0


if __name__ == "__main__":
    sys.exit(part_of_job("gpt_parallel", "mpirun -n N python -m minitrain.examples.gpt [--tp T] [--pp P] [--cp C] ..."))

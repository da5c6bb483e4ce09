"""The GPT job with MoE layers on dp ranks: mpirun -n D python -m minitrain.examples.gpt --moe-experts E [--ep N].

Data parallelism: each replica takes its contiguous rows of the global batch (as GPT3D cuts them), routes
its own tokens, and counts capacity and the load-balancing loss over its G/D of the global batch's G groups
(GShard's groups, --moe-groups, default G = D). The mean of the replicas' losses is the global batch's loss
with those G groups, so one process given --moe-groups G trains the same model: the same losses, the same
tokens dropped. --ep 1 (default): every rank holds every expert (DistributedDataParallel).
--ep N: expert parallelism carved out of the data-parallel ranks, as Megatron-Core does: blocks of N
consecutive dp ranks form an expert-parallel group, each of its ranks holding E/N experts; tokens go to
their experts' ranks and back by all_to_all_single (parallel/expert_parallel_moe.py). Dense gradients
are averaged over the D ranks, the experts' summed over the D/N ranks holding the same experts and
divided by D (parallel/expert_data_parallel.py). The table and --json add the all-to-all bytes this
rank sent per step, measured on the expert-parallel communicator, beside the formula from the split
sizes the run used (0 with --ep 1).
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
from minitrain.examples.common import PRECISIONS, checks_line, init_comm, mpi_line, part_of_job, tqdm, transport_name
from minitrain.examples.gpt_common import (MIXED, adamw, all_to_all_sent, all_to_all_step, all_to_all_summary,
                                           estimate_loss, gpt_config, grad_norms, layout, mixed_precision, moe_layers,
                                           moe_step, moe_summary, nothing_left, routing_load, routing_step,
                                           print_sample, scheduler_for)
from minitrain.examples.report import (MODEL_STATE, StepWatch, gather_steps, plan_comparison,
                                       show_plan, write_json)
from minitrain.parallel import DistributedDataParallel, found_inf_on_any_rank, offload_activations
from minitrain.parallel.expert_data_parallel import ExpertDataParallel, expert_parallel_groups
from minitrain.parallel.expert_parallel_moe import full_state_dict, shard_experts


def gather_memory(comm, persistent):
    """Every rank's ledger (every rank calls it): [{"persistent": model states at the last optimizer step,
    "peak": each category's own peak over the run and the total's}], as the other GPT jobs' --json has it."""
    peak = memory.peak()
    row = np.array([persistent.get(c, 0) for c in MODEL_STATE] + [peak[c] for c in memory.CATEGORIES]
                   + [peak["total"]], np.float64)
    table = mtcomm.ring_all_gather(comm, row, total=row.size * comm.size).reshape(comm.size, -1)
    k = len(MODEL_STATE)
    return [{"persistent": dict(zip(MODEL_STATE, map(int, v[:k]))),
             "peak": {**dict(zip(memory.CATEGORIES, map(int, v[k:-1]))), "total": int(v[-1])}} for v in table]


def main_moe_dp(args):
    comm = init_comm(args)
    world, rank = comm.size, comm.rank
    dp, ep = world, args.ep
    if args.dp is not None and args.dp != world:
        if rank == 0:
            sys.stderr.write(f"error: --dp {args.dp} with MoE layers is plain data parallelism over every rank, but "
                             f"this job has {world} (mpirun -n {args.dp})\n")
        return 2
    minitrain.manual_seed(args.seed)
    corpus = load_text()
    config = gpt_config(args, corpus.vocab_size, dp)                    # the global batch's groups
    model = nn.GPT(gpt_config(args, corpus.vocab_size, dp, replica=True)).to(PRECISIONS[args.precision])
    rng = np.random.default_rng(args.seed)                              # the same batches on every rank
    val_rng = np.random.default_rng(args.seed + 1)
    # 16-bit gradients: backward seeded with the loss scale / dp and the replicas' gradients summed (gpt_3d.py's
    # order): a replica's gradient is then no larger than one process's, and fp16 overflows only where it would
    mixed = args.precision in MIXED
    if ep > 1:
        ep_comm, expert_dp_comm = expert_parallel_groups(comm, ep)
        ep_layers = shard_experts(model, ep_comm)                       # this rank keeps E/ep experts per layer
        ddp = ExpertDataParallel(model, comm, ep_comm, expert_dp_comm, pre_divided=mixed)
    else:
        ep_comm, ep_layers = None, []
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True,   # an idle expert keeps grad None
                                      reduce_op="sum" if mixed else "mean")
    # mixed precision: fp32 masters; with --ep the ranks hold different experts, so all of them agree to skip
    opt = adamw(model.parameters(), args, args.init_scale, found_inf_on_any_rank(comm) if ep > 1 else None)
    seeded = [layer for layer in moe_layers(model) if layer.aux_loss_scale is not None]   # full recomputation
    scheduler = scheduler_for(opt, args)
    ckpt = checkpointing.Checkpointer(args, comm, model, opt, scheduler, layout=layout(args, "dp", dp, 1, 1, world),
                                      **checkpointing.data_rng(rng))
    try:
        first_step = ckpt.start_step()
    except CheckpointError as e:
        return checkpointing.fail(comm, e)

    def global_model():
        """Rank 0's copy over the whole batch's groups: validation as one process computes it (every rank
        calls it: with --ep, each expert-parallel group gathers its experts; None but on rank 0)."""
        state = full_state_dict(model, ep_comm) if ep > 1 else model.state_dict()
        if rank != 0:
            return None
        with minitrain.random.use_generator(minitrain.random.fork()):
            full = nn.GPT(config).to(PRECISIONS[args.precision])
        full.load_state_dict(state)
        return full
    start_model = global_model()
    initial_val = estimate_loss(start_model, corpus, args, val_rng) if rank == 0 else None
    del start_model                        # rank 0's whole copy is not held through the run (the ledger's peak)
    memory.reset_peak()
    B = args.batch_size
    rows = slice(rank * B // dp, (rank + 1) * B // dp)                  # contiguous, in order (B % G == 0)
    losses, norms, moe, a2a, routing = [], [], [], [], []              # a2a: (measured, formula) bytes per step
    bar = tqdm(range(first_step, args.steps), disable=args.no_progress or rank != 0, file=sys.stdout,
               desc=f"dp{dp} moe", unit="step")
    comm.barrier()
    start = time.perf_counter()
    watch = StepWatch()
    offload = offload_activations() if args.offload_activations else contextlib.nullcontext()
    for step in bar:
        x, y = corpus.get_batch("train", B, args.block_size, rng)
        sent_before = all_to_all_sent(ep_comm)
        with watch.step():
            scale = getattr(opt, "loss_scale", 1.0)                    # mixed precision's (1 for fp32 / fp64)
            seed = scale / dp if mixed else 1.0
            for layer in seeded:                                       # their aux loss's gradient, scaled alike
                layer.main_loss_backward_scale = seed
            with offload:
                _, loss = ddp(x[rows], y[rows])
            opt.zero_grad()
            (loss * seed if mixed else loss).backward()                # DDP: the replicas' mean (dense) gradient
            if ep > 1:
                ddp.reduce_expert_gradients()
                norms.append(ddp.clip_grad_norm_(1.0, loss_scale=scale))
            elif mixed:
                norms.append(opt.clip_grad_norm_(1.0))                 # by the norm over the scale
            else:
                norms.append(optim.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            scheduler.step()
        losses.append(float(mtcomm.all_reduce(comm, np.array([loss.item()]), op="sum")[0]) / dp)
        moe.append(moe_step(model, comm))
        a2a.append(all_to_all_step(ep_comm, ep_layers, sent_before))
        routing.append(routing_step(moe_layers(model)))
        ckpt.after_step(step + 1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    ckpt.finish(first_step + len(losses))
    if not losses:
        return nothing_left(args, first_step, rank, world)
    step_by_rank, slowest = gather_steps(comm, watch.timer)
    memory_by_rank = gather_memory(comm, watch.persistent)
    skipped = (mtcomm.ring_all_gather(comm, np.array([float(opt.skipped_steps)]), total=comm.size)   # every rank's
               if mixed else None)
    a2a_measured, a2a_formula, a2a_by_rank, a2a_line = all_to_all_summary(comm, a2a, ep)   # (rank, step, 2)
    load = routing_load(comm, routing, ep, per_layer=args.recompute == "full")
    full = global_model()
    if rank != 0:
        return 0
    final_val = estimate_loss(full, corpus, args, val_rng)
    head, tail = np.mean(losses[:10]), np.mean(losses[-10:])
    moe_block, moe_line = moe_summary(moe)
    placed = (f"replicated on {dp}" if ep == 1 else
              f"sharded over expert-parallel groups of {ep} ({args.moe_experts // ep} per rank), {dp}")
    print(f"GPT {full.num_parameters():,} parameters, {args.moe_experts} experts per MoE layer {placed} "
          f"data-parallel ranks [{minitrain.backend.describe_device()} on rank 0, transport {transport_name(comm)}]")
    print(f"MPI: {mpi_line()}; {checks_line(args)}")
    print(f"train loss {head:.3f} (first 10 steps) -> {tail:.3f} (last 10); val loss {initial_val:.3f} -> "
          f"{final_val:.3f}; {1 / slowest['step_time_s']:.1f} steps/s (steady state)")
    print(moe_line)
    print(a2a_line)
    compared = plan_comparison(args, world, slowest, max(m["peak"]["total"] for m in memory_by_rank), kind="gpt",
                               vocab_size=corpus.vocab_size, moe_load=load[0], moe_load_step=load[1])
    show_plan(args, compared)
    print_sample(full, config, corpus, args)
    if args.json:
        write_json(args.json, {
            "world_size": world, "mpi_library": mpi_line(), "comm_timeout": args.comm_timeout, "check_collectives": args.check_collectives, "strategy": "dp",
            "dp": dp, "pp": 1, "tp": 1, "ep": ep, "transport": transport_name(comm), "dropout": args.dropout,
            "recompute": args.recompute, "offload_activations": args.offload_activations, "planner": compared,
            "num_params": full.num_parameters(), "initial_val_loss": initial_val,
            "final_val_loss": final_val, "final_loss": float(tail), "elapsed_seconds": elapsed,
            "steps_per_second": 1 / slowest["step_time_s"], "tokens_per_second": B * args.block_size / slowest["step_time_s"],
            "steady_state": watch.steady_state(), "precision": args.precision, **mixed_precision(opt),
            "first_step": first_step, "grad_norms": grad_norms(norms),
            "losses": losses, "moe": moe_block, "all_to_all_bytes_per_step": a2a_measured,
            "all_to_all_bytes_formula": a2a_formula, **slowest, "blas_threads": minitrain.backend.blas_threads(),
            "ranks": [{"rank": r, "step": s, "memory": memory_by_rank[r],
                       "all_to_all_bytes": a2a_by_rank[r, :, 0].tolist(),
                       "all_to_all_bytes_formula": a2a_by_rank[r, :, 1].tolist(),
                       **({"skipped_steps": int(skipped[r])} if mixed else {})} for r, s in enumerate(step_by_rank)]})
    return 0


if __name__ == "__main__":
    sys.exit(part_of_job("gpt_moe", "[mpirun -n D] python -m minitrain.examples.gpt --moe-experts E [--ep N]"))

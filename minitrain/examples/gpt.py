"""Train the small GPT on a character-level corpus (Python's own standard library sources).

    python -m minitrain.examples.gpt [--steps 600] [--precision fp32|fp64|fp16|bf16 [--init-scale S]] [--json out.json]
        [--show-plan]
        [--save-dir DIR --save-every N --resume]
    mpirun -n 2 python -m minitrain.examples.gpt --tp 2 [--sequence-parallel]
    mpirun -n 8 python -m minitrain.examples.gpt --tp 2 --pp 2 [--dp 2] --microbatches 4 [--zero 1|2|3]
    mpirun -n 2 python -m minitrain.examples.gpt --pp 2 --schedule zb_h1|zbv --microbatches 4
    [mpirun -n D] python -m minitrain.examples.gpt --moe-experts 4 --moe-top-k 2 [--moe-capacity-factor 1.25] [--ep N]
    mpirun -n 4 python -m minitrain.examples.gpt --moe-experts 4 --tp 2 --pp 2 --microbatches 2
    mpirun -n 4 python -m minitrain.examples.gpt --moe-experts 4 --tp 2 --ep 2   (or --pp 2 --microbatches 2 --ep 2)
    mpirun -n 4 python -m minitrain.examples.gpt --cp 2 [--cp-method ring|ulysses] [--tp 2 | --dp 2 | --pp 2]

Prints the loss as it falls, the validation loss, and a sample of generated text. Under
mpirun -n N the ranks form a dp x pp x cp x tp mesh (minitrain/examples/gpt_parallel.py):
--tp splits every weight matrix (Megatron-LM), --pp cuts the layers into pipeline stages, --cp the
sequence, and the rest is data parallelism (--dp defaults to N / (pp·cp·tp)); --zero shards the optimizer state,
gradients, parameters over it (ZeRO-1, 2, 3; parallel/zero_3d.py). The learning rate warms up
linearly for --warmup-steps and then decays by a cosine to a tenth (--lr-schedule). Checkpoints
(--save-dir) resume on any of these layouts: GPT dp=4 -> tp=2 x pp=2 -> one process.
--cp N splits every sequence over N ranks (context parallelism: ring attention with the zig-zag layout, or
DeepSpeed-Ulysses' all-to-alls; parallel/context_parallel/); the table and --json report its bytes and balance.
--moe-experts E puts a mixture of experts in place of every --moe-every-th block's MLP (one process;
data parallelism in gpt_moe.py, where --ep N shards the experts over blocks of N data-parallel ranks;
with --tp, --pp, --cp or --microbatches, GPT3D with the experts replicated on the tp ranks (under --cp, and
--sequence-parallel, each rank routes its own tokens), and with --ep N sharded over blocks of N dp replicas
of each stage, tp and cp coordinate); the table and
--json report its load, dropped tokens, balancing loss and all-to-all bytes. Capacity
groups (--moe-groups G, default one per replica and micro-batch) are counted per micro-batch: one
process given the run's G trains the same model.
--precision fp16|bf16: mixed precision on any of these layouts (16-bit parameters and activations; LayerNorm,
softmax and the losses in fp32; fp32 master weights and AdamW state; fp16's dynamic loss scale from
--init-scale; a step any rank's gradient overflowed is skipped by all: "skipped_steps" in --json; with --zero and
--ep the dense and the experts' shards skip together). --json's "grad_norms": each step's gradient norm before
clipping (the scale divided out).
"""
import sys
import time

import numpy as np

import minitrain
from minitrain import cli, memory, nn
from minitrain.checkpoint import CheckpointError
from minitrain.data import load_text
from minitrain.examples import checkpointing
from minitrain.examples.common import PRECISIONS, job_parser, launch_info, parse_job_args, tqdm
from minitrain.examples.gpt_common import (MIXED, adamw, backward_and_clip, estimate_loss, gpt_config, grad_norms,
                                          layout, mixed_precision, moe_layers, moe_step, moe_summary, nothing_left,
                                          print_sample, routing_load, routing_step, scheduler_for)
from minitrain.examples.report import (StepWatch, fmt_bytes, memory_table, plan_comparison, show_plan,
                                       write_json)
from minitrain.examples.options import refuse_unsupported
from minitrain.parallel import offload_activations
from minitrain.plan import runs_moe_on_dp
from minitrain.plan.experts import moe_groups_problem


def parse_args(argv=None):
    p = job_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=cli.positive_int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=cli.positive_int, default=16, help="global batch: sequences per step, all replicas together")
    p.add_argument("--block-size", type=cli.positive_int, default=32, help="context length in characters")
    p.add_argument("--n-layer", type=cli.positive_int, default=2, help="transformer blocks")
    p.add_argument("--n-head", type=cli.positive_int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=cli.positive_int, default=64, help="embedding width")
    p.add_argument("--dropout", type=cli.probability, default=0.0,
                   help="dropout probability (one process's masks on any layout; with --moe-experts, dp replicas, "
                        "micro-batches and pipeline stages draw their own)")
    p.add_argument("--lr", type=cli.nonneg_float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                   help="cosine: linear warm-up, then cosine decay to lr/10 at --steps (LambdaLR(warmup_cosine)); "
                   "constant: linear warm-up, then --lr (Megatron's constant decay style)")
    p.add_argument("--warmup-steps", type=cli.nonneg_int, default=None,
                   help="steps of linear warm-up (default: steps // 10, at most 100, with cosine; 0 with constant)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="parameters' and activations' dtype; fp16/bf16: mixed precision (fp32 master weights and "
                        "AdamW state, LayerNorm, softmax and the loss in fp32; fp16 with a dynamic loss scale)")
    p.add_argument("--init-scale", type=cli.positive_float, default=2.0 ** 16,
                   help="fp16: the dynamic loss scale's first value (PyTorch's GradScaler init_scale)")
    p.add_argument("--seed", type=cli.nonneg_int, default=0, help="seeds the model, the data order and dropout")
    p.add_argument("--sample-chars", type=cli.nonneg_int, default=200, help="characters sampled from the trained model")
    p.add_argument("--recompute", choices=["none", "full", "selective"], default="none",
                   help="activation recomputation: each block (full) or the attention core (selective)")
    p.add_argument("--offload-activations", action="store_true", help="park saved activations in host memory")
    p.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel ranks (run under mpirun -n TP)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorm and dropout regions split along the sequence (Korthikanti et al.)")
    p.add_argument("--pp", type=cli.positive_int, default=1, help="pipeline stages")
    p.add_argument("--dp", type=cli.positive_int, default=None, help="data-parallel replicas (default: ranks / (pp·tp))")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"], default="1f1b",
                   help="pipeline schedule (with --pp); zb_h1 and zbv split each backward into B (input gradient) "
                        "and W (weight gradient, deferred to fill the bubble)")
    p.add_argument("--microbatches", type=cli.positive_int, default=1, help="micro-batches per replica and step")
    p.add_argument("--chunks", type=cli.positive_int, default=1,
                   help="virtual stages per rank (interleaved_1f1b; zbv always has 2)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO over the data-parallel replicas: 1 the optimizer state, 2 also the gradients, 3 also "
                        "the parameters, each stage's sharded over dp (Megatron's distributed optimizer is 1)")
    cp = p.add_argument_group("context parallelism (parallel/context_parallel/)")
    cp.add_argument("--cp", type=cli.positive_int, default=1, metavar="N",
                    help="context-parallel ranks: each holds block-size/N positions of every sequence")
    cp.add_argument("--cp-method", choices=["ring", "ulysses"], default="ring",
                    help="ring: K/V blocks round a ring, zig-zag layout (2N chunks, rank r holds r and 2N-1-r); "
                         "ulysses: all-to-alls from sequence- to head-sharded around attention (contiguous layout)")
    moe = p.add_argument_group("mixture of experts (nn/moe.py; experts replicated on the tp ranks, or sharded over dp by --ep)")
    moe.add_argument("--moe-experts", type=cli.nonneg_int, default=0,
                     help="experts per MoE layer; 0: every block keeps its dense MLP")
    moe.add_argument("--moe-top-k", type=cli.positive_int, default=2, help="experts each token is routed to")
    moe.add_argument("--moe-capacity-factor", type=cli.positive_float, default=None,
                     help="an expert takes at most ceil(factor·S·k/E) choices per group of S tokens, the rest are "
                          "dropped (default: dropless)")
    moe.add_argument("--moe-every", type=cli.positive_int, default=1,
                     help="an MoE layer replaces the MLP of every N-th block")
    moe.add_argument("--moe-aux-loss-coef", type=cli.nonneg_float, default=0.01,
                     help="the load-balancing loss's weight (Switch's alpha)")
    moe.add_argument("--moe-groups", type=cli.positive_int, default=None,
                     help="GShard's groups: the global batch's rows cut into G contiguous groups, capacity and the "
                          "balancing loss counted per group; a multiple of dp x micro-batches, each micro-batch "
                          "of each replica holding G/(dp·m) of them (default: dp x micro-batches, 1 in one process)")
    moe.add_argument("--ep", type=cli.positive_int, default=1,
                     help="expert-parallel ranks: each block of EP consecutive data-parallel ranks holds every expert "
                          "once, E/EP per rank, tokens dispatched by all-to-all (EP divides the data-parallel ranks "
                          "and --moe-experts)")
    p.add_argument("--json", type=cli.output_file, metavar="PATH",
                   help="write the run's figures as JSON (default: none written)")
    p.add_argument("--show-plan", action="store_true", help="also print the planner's prediction beside the measured "
                   "step (busy CPU and wall clock, in anchor units) and memory; always in --json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    checkpointing.add_arguments(p)
    args = parse_job_args(p, argv)
    checkpointing.check_arguments(p, args)
    refuse_unsupported(p, args, argv, "gpt")
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.steps // 10) if args.lr_schedule == "cosine" else 0
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be divisible by --n-head {args.n_head}")
    if args.tp > 1 and args.n_head % args.tp:
        p.error(f"--n-head {args.n_head} is not divisible by --tp {args.tp}: each rank takes whole heads")
    if args.sequence_parallel and args.block_size % args.tp:
        p.error(f"--block-size {args.block_size} is not divisible by --tp {args.tp} (sequence parallelism)")
    if args.sequence_parallel and args.tp == 1:
        p.error("--sequence-parallel needs --tp > 1")
    if args.chunks > 1 and args.schedule not in ("interleaved_1f1b", "zbv"):
        p.error("--chunks > 1 needs --schedule interleaved_1f1b")
    if args.schedule == "zbv":
        args.chunks = 2                     # zbv's V: the first and last virtual stages on rank 0
    check_cp(p, args)
    check_moe(p, args)
    checkpointing.check_resume(p, args, "gpt")
    return args


def check_cp(p, args):
    if args.cp == 1:
        return
    chunks = 2 * args.cp if args.cp_method == "ring" else args.cp
    if args.block_size % chunks:
        p.error(f"--block-size {args.block_size} does not split into {chunks} equal chunks "
                f"(--cp {args.cp} --cp-method {args.cp_method})")
    if args.cp_method == "ulysses" and args.n_head % (args.cp * args.tp):
        p.error(f"--n-head {args.n_head} is not divisible by --cp {args.cp} x --tp {args.tp}: Ulysses gives each "
                f"rank whole heads")
    if args.sequence_parallel and (args.block_size // args.cp) % args.tp:
        p.error(f"--block-size {args.block_size} / --cp {args.cp} is not divisible by --tp {args.tp} "
                f"(sequence parallelism splits each rank's positions)")


def check_moe(p, args):
    if not args.moe_experts:
        return
    if args.moe_top_k > args.moe_experts:
        p.error(f"--moe-top-k {args.moe_top_k} exceeds --moe-experts {args.moe_experts}")
    if args.moe_every > args.n_layer:
        p.error(f"--moe-every {args.moe_every} exceeds --n-layer {args.n_layer}: no block would be an MoE layer")
    dp = args.dp or max(1, launch_info()[1] // (args.tp * args.pp * args.cp))    # as gpt_parallel's mesh
    problem = moe_groups_problem(args.moe_groups or dp * args.microbatches, dp, args.microbatches, args.batch_size)
    if problem:   # the default groups (dp x m) can only fail to split the batch
        p.error(problem + ("" if args.moe_groups else " (its default: one per data-parallel replica and micro-batch)"))
    if args.moe_experts % args.ep:
        p.error(f"--ep {args.ep} does not divide --moe-experts {args.moe_experts}: each rank holds E/ep whole experts")
    if dp % args.ep:
        p.error(f"--ep {args.ep} does not divide the {dp} data-parallel ranks: an expert-parallel group is ep of them")


def main(argv=None):
    """Run the job on a memory ledger of its own (as the serving job does; its collectives' progress thread
    takes the ledger of the thread that submits to it): its tables count the bytes this job holds, whatever
    else the process (a notebook, a test session) still holds or frees meanwhile."""
    with memory.use_tracker(memory.MemoryTracker()):
        return _main(argv)


def _main(argv=None):
    args = parse_args(argv)
    _, launched = launch_info()
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    if runs_moe_on_dp(args.moe_experts, launched, args.dp or 1, args.tp, args.pp, args.cp, args.microbatches, args.zero,
                      args.ep, args.save_dir):                     # the planner routes it alike
        from minitrain.examples.gpt_moe import main_moe_dp
        return main_moe_dp(args)
    if launched > 1 or args.tp > 1 or args.pp > 1 or args.cp > 1 or (args.dp or 1) > 1 or args.microbatches > 1 or args.zero:
        from minitrain.examples.gpt_parallel import main_parallel
        return main_parallel(args)
    minitrain.backend.limit_blas_threads()
    minitrain.backend.hold_host_memory()

    minitrain.manual_seed(args.seed)
    corpus = load_text()
    config = gpt_config(args, corpus.vocab_size)
    model = nn.GPT(config).to(PRECISIONS[args.precision])
    opt = adamw(model.parameters(), args, args.init_scale)
    seeded = [layer for layer in moe_layers(model) if layer.aux_loss_scale is not None]   # full recomputation
    scheduler = scheduler_for(opt, args)
    rng = np.random.default_rng(args.seed)                   # training batches (as the parallel job's)
    val_rng = np.random.default_rng(args.seed + 1)           # validation batches
    print(f"GPT {config} — {model.num_parameters():,} parameters, corpus {len(corpus.text):,} chars, "
          f"on {minitrain.backend.describe_device()}")
    ckpt = checkpointing.Checkpointer(args, None, model, opt, scheduler, layout=layout(args), **checkpointing.data_rng(rng))
    try:
        first_step = ckpt.start_step()
    except CheckpointError as e:
        return checkpointing.fail(None, e)

    memory.reset_peak()
    initial_val = estimate_loss(model, corpus, args, val_rng)
    losses, norms = [], []
    bar = tqdm(range(first_step, args.steps), disable=args.no_progress, file=sys.stdout, desc="train", unit="step")
    start = time.perf_counter()
    offload = offload_activations() if args.offload_activations else None
    watch = StepWatch()
    moe, routing = [], []                                    # routing: the rows the experts took, per step
    routing_step(moe_layers(model))                          # (not the validation's)
    for step in bar:
        x, y = corpus.get_batch("train", args.batch_size, args.block_size, rng)
        with watch.step():
            for layer in seeded:                             # their aux loss's gradient, scaled as the loss
                layer.main_loss_backward_scale = getattr(opt, "loss_scale", 1.0)
            if offload is not None:
                with offload:
                    _, loss = model(x, y)
            else:
                _, loss = model(x, y)
            opt.zero_grad()
            norms.append(backward_and_clip(opt, loss, model.parameters()))
            opt.step()
            scheduler.step()
        losses.append(loss.item())
        if config.moe_experts:
            moe.append(moe_step(model))
            routing.append(routing_step(moe_layers(model)))
        ckpt.after_step(step + 1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    ckpt.finish(first_step + len(losses))
    if not losses:
        return nothing_left(args, first_step)
    final_val = estimate_loss(model, corpus, args, val_rng)
    peak = memory.peak()

    head = np.mean(losses[:10])
    tail = np.mean(losses[-10:])
    steps = watch.timer.summary()
    print(f"train loss {head:.3f} (first 10 steps) -> {tail:.3f} (last 10); "
          f"val loss {initial_val:.3f} -> {final_val:.3f}; {1 / steps['step_time_s']:.1f} steps/s (steady state)")
    print_sample(model, config, corpus, args)
    print(f"recompute: {args.recompute}; peak saved activations {fmt_bytes(peak['activations'])}"
          + (f"; offloaded {fmt_bytes(offload.bytes_offloaded / len(losses))} per step" if offload else ""))
    moe_block, moe_line = moe_summary(moe) if moe else (None, None)
    if moe_line:
        print(moe_line)
    print("memory on rank 0 (model states at the optimizer step; peak over the run):")
    print(memory_table(watch.persistent, peak))
    load = routing_load(None, routing, 1, per_layer=args.recompute == "full")     # a capacity's drops: below 1
    compared = plan_comparison(args, 1, steps, peak["total"], kind="gpt", vocab_size=corpus.vocab_size,
                               moe_load=load[0], moe_load_step=load[1])
    show_plan(args, compared)
    if args.json:
        write_json(args.json, {
            "world_size": 1, "strategy": "single", "num_params": model.num_parameters(),
            "initial_val_loss": initial_val, "final_val_loss": final_val,
            "final_loss": float(tail), "steps_per_second": 1 / steps["step_time_s"], "elapsed_seconds": elapsed,
            "steady_state": watch.steady_state(), "planner": compared, "recompute": args.recompute,
            "offload_activations": args.offload_activations,
            "bytes_offloaded_per_step": offload.bytes_offloaded / len(losses) if offload else 0,
            "tokens_per_second": args.batch_size * args.block_size / steps["step_time_s"],
            **steps, "blas_threads": minitrain.backend.blas_threads(),
            "precision": args.precision, **mixed_precision(opt), "first_step": first_step, "losses": losses,
            "grad_norms": grad_norms(norms),
            **({"moe": moe_block, "ep": 1, "all_to_all_bytes_per_step": 0, "all_to_all_bytes_formula": 0}
               if moe_block else {}),
            "ranks": [{"rank": 0, "device": minitrain.backend.describe_device().split()[0],
                       "memory": {"persistent": watch.persistent, "peak": peak}, "bytes_sent": 0, "step": steps,
                       **({"skipped_steps": opt.skipped_steps} if args.precision in MIXED else {})}],
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())

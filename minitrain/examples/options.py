"""Every option a job takes is applied or refused: the combinations a job would silently ignore.

Each job calls refuse_unsupported(parser, args, argv, job) right after parsing, before MPI starts or
any model is built, so an option its strategy cannot apply stops it with argparse's one line and exit
status 2: "error: --recompute is not supported with --strategy pipeline (...)". Values out of range are
refused earlier still, by the type= of each option (minitrain/cli.py). An option is refused when the
command line gives it (whatever its value, found by cli.given_options) or, for an option whose default
means "none" (a flag, --recompute none, --device-memory unset), when it asks for something.
"""
from .. import cli
from ..plan import MLP_PIPELINE_PRECISIONS

MLP_PIPELINE_ONLY = ("--schedule", "--microbatches", "--chunks", "--dp")
#: what the pipeline job does not apply, when asked for, and why
MLP_NOT_IN_PIPELINE = (
    ("--recompute", lambda a: a.recompute != "none",
     "the pipeline runtime keeps each micro-batch's activations until its backward; recomputation is wired "
     "into the data-parallel strategies"),
    ("--offload", lambda a: a.offload, "each stage steps a plain optimizer on the device; ZeRO-Offload is "
                                       "wired into ddp, local_sgd and the ZeRO stages"),
    ("--offload-activations", lambda a: a.offload_activations,
     "the pipeline's activations cross ranks as messages and are not parked on the host"),
    ("--device-memory", lambda a: a.device_memory is not None,
     "every rank builds the whole model before keeping its stages, and the job sets no device capacity"),
    ("--precision", lambda a: a.precision not in MLP_PIPELINE_PRECISIONS,
     "each stage runs in fp32 or fp64; mixed precision (fp32 master weights, loss scaling) is wired into ddp, "
     "local_sgd and the ZeRO stages"),
)
BUCKETED = ("ddp", "zero1", "zero2")


def refuse_mlp(parser, args, given):
    strategy = f"--strategy {args.strategy}"
    if args.strategy != "pipeline":
        for option in MLP_PIPELINE_ONLY:
            if option in given:
                cli.refuse(parser, option, strategy, "only --strategy pipeline has a schedule, micro-batches, model "
                                                     "chunks and pipeline replicas; data parallelism here spans every "
                                                     "rank")
    else:
        for option, asked, why in MLP_NOT_IN_PIPELINE:
            if asked(args):
                cli.refuse(parser, option, strategy, why)
    if "--sync-every" in given and args.strategy != "local_sgd":
        cli.refuse(parser, "--sync-every", strategy, "only local_sgd averages the parameters every N steps; "
                                                     "the others average every step's gradients")
    if "--bucket-cap-mb" in given and args.strategy not in BUCKETED:
        cli.refuse(parser, "--bucket-cap-mb", strategy, f"only {', '.join(BUCKETED)} put gradients in buckets")


def refuse_longer_than_the_corpus(parser, option, value, splits):
    """A context window must fit the corpus's splits (a window and the character after it, at a random start)."""
    from ..data import load_text
    corpus = load_text()
    for split in splits:
        longest = len(getattr(corpus, split)) - 2
        if value > longest:
            parser.error(f"argument {option}: must be at most {longest} (the corpus's {split} split has "
                         f"{longest + 2} characters), got {value}")


MOE_OPTIONS = ("--moe-top-k", "--moe-capacity-factor", "--moe-every", "--moe-aux-loss-coef", "--moe-groups")


def refuse_moe(parser, args, given):
    if not args.moe_experts:
        for option in MOE_OPTIONS:
            if option in given:
                cli.refuse(parser, option, "--moe-experts 0", "no block has an MoE layer: give --moe-experts E")
        return
    if args.sequence_parallel:
        cli.refuse(parser, "--sequence-parallel", f"--moe-experts {args.moe_experts}",
                   "the experts are replicated on the tp ranks and route whole sequences; routing by sequence "
                   "shard is not built")


def refuse_ep(parser, args, given):
    if "--ep" in given and not args.moe_experts:
        cli.refuse(parser, "--ep", "--moe-experts 0", "no block has experts to shard: give --moe-experts E")


def refuse_cp(parser, args, given):
    if args.cp == 1:
        if "--cp-method" in given:
            cli.refuse(parser, "--cp-method", "--cp 1", "one rank holds the whole sequence: give --cp 2 or more")
        return
    setting = f"--cp {args.cp}"
    if args.dropout > 0:
        cli.refuse(parser, "--dropout", setting, "each context-parallel rank would draw its chunk's masks, not one "
                                                  "process's, and ring attention has no attention dropout")


def refuse_gpt(parser, args, given):
    refuse_longer_than_the_corpus(parser, "--block-size", args.block_size, ("train", "val"))
    refuse_gpt_layout(parser, args, given)


def refuse_gpt_layout(parser, args, given):
    """What the GPT job refuses of a layout, whatever its sizes (the planner refuses the same)."""
    refuse_ep(parser, args, given)
    refuse_moe(parser, args, given)
    refuse_cp(parser, args, given)
    if args.pp == 1:
        for option in ("--schedule", "--chunks"):
            if option in given:
                cli.refuse(parser, option, "--pp 1", "one stage has no pipeline schedule: give --pp 2 or more")
    if "--chunks" in given and args.schedule == "zb_h1":
        cli.refuse(parser, "--chunks", "--schedule zb_h1", "ZB-H1 runs one chunk per rank; zbv is the zero-bubble "
                                                          "schedule with 2, a V")
    if "--chunks" in given and args.schedule == "zbv" and args.chunks != 2:
        cli.refuse(parser, f"--chunks {args.chunks}", "--schedule zbv", "its V is exactly 2 chunks per rank: "
                                                                         "give --chunks 2 or leave it out")


def refuse_generate(parser, args, given):
    if args.train_steps and not args.checkpoint:
        refuse_longer_than_the_corpus(parser, "--context", args.context, ("train",))
    if args.checkpoint:
        for option in ("--train-steps", "--batch-size", "--lr"):
            if option in given:
                cli.refuse(parser, option, "--checkpoint", "the model is loaded from the checkpoint, not trained")
    for option, why in (("--block-size", "only the paged cache has blocks"),
                        ("--preempt", "only the paged cache preempts sequences")):
        if option in given and args.cache != "paged":
            cli.refuse(parser, option, f"--cache {args.cache}", why)
    if "--preempt" in given and args.device_memory is None:
        cli.refuse(parser, "--preempt", "no --device-memory", "without a capacity no sequence is ever preempted")
    if "--top-k" in given and args.temperature == 0:
        cli.refuse(parser, "--top-k", "--temperature 0", "greedy decoding takes the likeliest token; "
                                                         "give --temperature > 0 to sample among the top k")


RULES = {"mlp": refuse_mlp, "gpt": refuse_gpt, "generate": refuse_generate}
#: what python -m minitrain.plan mlp|gpt refuses: the jobs' rules for a layout (a planned GPT may be any size)
LAYOUT_RULES = {"mlp": refuse_mlp, "gpt": refuse_gpt_layout}


def refuse_unsupported(parser, args, argv, job, rules=RULES):
    """Stop with one line (exit 2) if ``argv`` asks ``job`` for something it cannot apply."""
    rules[job](parser, args, cli.given_options(parser, argv))

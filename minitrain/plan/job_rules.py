"""What the jobs refuse of a layout: an option their strategy would not apply, a combination not built.

The mlp and gpt jobs (examples/options.py) and the planner's mirror of their command lines
(python -m minitrain.plan mlp|gpt) apply these same rules right after parsing, so that a layout is
never run, nor planned, with an option silently dropped: argparse's one line and exit status 2, "error:
--recompute is not supported with --strategy pipeline (...)". An option is refused when the command line
gives it (whatever its value, cli.given_options) or, for one whose default means "none", when it asks for
something. What depends on the job's own data (the corpus bounds --block-size) stays with the job.
The planner's own options (--top, the experts' sizes, --threads) are refused the same way where nothing
would read them.
"""
from .. import cli
from . import MLP_PIPELINE_PRECISIONS

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


MOE_OPTIONS = ("--moe-top-k", "--moe-capacity-factor", "--moe-every", "--moe-aux-loss-coef", "--moe-groups")


def refuse_moe(parser, args, given):
    if not args.moe_experts:
        for option in MOE_OPTIONS:
            if option in given:
                cli.refuse(parser, option, "--moe-experts 0", "no block has an MoE layer: give --moe-experts E")


def refuse_ep(parser, args, given):
    if "--ep" in given and not args.moe_experts:
        cli.refuse(parser, "--ep", "--moe-experts 0", "no block has experts to shard: give --moe-experts E")


def refuse_cp(parser, args, given):
    if args.cp == 1:
        if "--cp-method" in given:
            cli.refuse(parser, "--cp-method", "--cp 1", "one rank holds the whole sequence: give --cp 2 or more")
        return


def refuse_gpt_layout(parser, args, given):
    """What the GPT job refuses of a layout, whatever its sizes (the planner refuses the same)."""
    refuse_ep(parser, args, given)
    refuse_moe(parser, args, given)
    refuse_cp(parser, args, given)
    if "--init-scale" in given and args.precision != "fp16":
        cli.refuse(parser, "--init-scale", f"--precision {args.precision}", "only fp16 scales its loss (bf16 has fp32's "
                                                                            "exponent range)")
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


#: job -> its layout rules (parser, args, given options)
LAYOUT_RULES = {"mlp": refuse_mlp, "gpt": refuse_gpt_layout}


#: the planner's own options on the gpt command that only an MoE model uses
EXPERT_SIZES = ("--moe-load", "--moe-shared", "--expert-hidden")


#: what --search chooses itself (plan/__main__.py's search; plan/layout.py's layouts for the GPT): one of these
#: given beside it would be dropped from the layouts it ranks
SEARCHED = {"mlp": ("--strategy", "--schedule", "--microbatches", "--chunks", "--dp"),
            "gpt": ("--dp", "--pp", "--tp", "--zero", "--schedule", "--microbatches", "--chunks",
                    "--sequence-parallel", "--recompute", "--offload-activations", "--ep", "--cp-method", "--moe-load",
                    "--threads")}
SEARCHED_WHY = {"--threads": "it prices each layout at the BLAS threads its job would take, cores / ranks",
                "--moe-load": "a load is the busiest of ep ranks, and the search tries every ep"}


def refuse_unplanned(parser, args, given):
    """The planner's own options where nothing would read them: refused in one line, as the jobs' rules above
    refuse theirs, rather than a plan printed as if they had counted."""
    if "--top" in given and not args.search:
        cli.refuse(parser, "--top", "one layout", "only --search ranks layouts: add --search")
    if args.search:
        for option in (o for o in SEARCHED.get(args.command, ()) if o in given):
            cli.refuse(parser, option, "--search", SEARCHED_WHY.get(option, "it picks the strategy, dp x tp x pp x "
                       "cp x ep, ZeRO, recomputation and micro-batches itself") + ": leave it out, or plan one layout "
                       "without --search")
    if args.command == "gpt" and not args.moe_experts:
        for option in (o for o in EXPERT_SIZES if o in given):
            cli.refuse(parser, option, "--moe-experts 0", "no block has experts: give --moe-experts E")
    if args.command == "params" and "--threads" in given:
        cli.refuse(parser, "--threads", "params", "it sizes the model states alone and times no step")


def refuse_threads(parser, args, machine):
    """--threads prices a CPU's BLAS threads per rank: none on a GPU machine, and at most its cores (the jobs
    give a rank cores / ranks; the calibration measured no more)."""
    name = machine.get("name", "").split(" (")[0]
    if machine.get("device", "cpu") != "cpu":
        cli.refuse(parser, "--threads", f"machine {name}", "a GPU machine: its ranks' work runs on the device, "
                                                          "priced without host threads")
    if machine.get("cores") and args.threads > machine["cores"]:
        parser.error(f"--threads {args.threads} exceeds the {machine['cores']} cores of machine {name} (the jobs "
                     f"give a rank at most cores / ranks BLAS threads)")

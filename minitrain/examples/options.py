"""Every option a job takes is applied or refused: the combinations a job would silently ignore.

Each job calls refuse_unsupported(parser, args, argv, job) right after parsing, before MPI starts or
any model is built, so an option its strategy cannot apply stops it with argparse's one line and exit
status 2: "error: --recompute is not supported with --strategy pipeline (...)". Values out of range are
refused earlier still, by the type= of each option (minitrain/cli.py). An option is refused when the
command line gives it (whatever its value, found by cli.given_options) or, for an option whose default
means "none" (a flag, --recompute none, --device-memory unset), when it asks for something. The rules
for a layout live in plan/job_rules.py, which the planner applies to the same command lines; what depends
on the job's own data (its corpus) is here.
"""
from .. import cli
from ..plan.job_rules import refuse_gpt_layout, refuse_mlp


def refuse_longer_than_the_corpus(parser, option, value, splits):
    """A context window must fit the corpus's splits (a window and the character after it, at a random start)."""
    from ..data import load_text
    corpus = load_text()
    for split in splits:
        longest = len(getattr(corpus, split)) - 2
        if value > longest:
            parser.error(f"argument {option}: must be at most {longest} (the corpus's {split} split has "
                         f"{longest + 2} characters), got {value}")


def refuse_gpt(parser, args, given):
    refuse_longer_than_the_corpus(parser, "--block-size", args.block_size, ("train", "val"))
    refuse_gpt_layout(parser, args, given)


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


def refuse_unsupported(parser, args, argv, job):
    """Stop with one line (exit 2) if ``argv`` asks ``job`` for something it cannot apply."""
    RULES[job](parser, args, cli.given_options(parser, argv))

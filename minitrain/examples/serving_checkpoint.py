"""The serving job's model from the gpt job's checkpoint: its sizes, precision and experts, then its weights.

As vLLM reads a model's configuration and dtype from its checkpoint, `generate --checkpoint DIR` takes
--context, --n-layer, --n-head, --n-embd and --precision from the newest checkpoint's manifest where
the command line leaves them out; given, they must be the checkpoint's (check_model names each that
differs; a dtype that differs is refused by the load). Without --checkpoint the job's own defaults apply.
"""
from minitrain import checkpoint
from minitrain.examples.checkpointing import check_model

#: option -> (the manifest's model key, the serving job's default without a checkpoint)
SIZES = {"context": ("block_size", 64), "n_layer": ("n_layer", 2), "n_head": ("n_head", 4), "n_embd": ("n_embd", 64)}
DEFAULT_PRECISION = "fp64"


def saved_layout(directory):
    """The layout the newest complete checkpoint in ``directory`` was saved with; {} where there is none
    (load_checkpoint then says so)."""
    try:
        path = checkpoint.find_latest(directory)
        return checkpoint.read_manifest(path).get("layout", {}) if path else {}
    except checkpoint.CheckpointError:
        return {}


def fill_model_options(args):
    """The options the command line left out (None): the checkpoint's where --checkpoint names one, else
    the job's defaults."""
    saved = saved_layout(args.checkpoint) if args.checkpoint else {}
    for option, (key, default) in SIZES.items():
        if getattr(args, option) is None:
            setattr(args, option, saved.get("model", {}).get(key, default))
    if args.precision is None:
        args.precision = saved.get("precision", DEFAULT_PRECISION)


def checkpoint_experts(directory):
    """The mixture of experts the gpt job saved in ``directory`` (--moe-experts, --moe-top-k, --moe-every
    from its manifest), served dropless: a capacity drops tokens by what else is in the batch, so the
    same prompt would continue differently beside other prompts (Mixtral and vLLM serve without one).
    {} for a dense model or no checkpoint (load_checkpoint says so)."""
    model = saved_layout(directory).get("model", {})
    if not model.get("moe_experts"):
        return {}
    return {key: model[key] for key in ("moe_experts", "moe_top_k", "moe_every", "moe_aux_loss_coef") if key in model}


def load_checkpoint(model, directory):
    """Load the newest checkpoint the gpt job saved in ``directory`` into ``model`` (same
    --n-layer/--n-head/--n-embd/--precision, and --context = the gpt job's --block-size), parameters
    only: any layout the gpt job saved from (dp, tp, pp) is resharded to this one process."""
    try:
        path = checkpoint.find_latest(directory)
        if path is None:
            raise ValueError(f"no checkpoint in {directory}")
        config = model.config
        check_model(checkpoint.read_manifest(path).get("layout", {}), {
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "block_size": config.block_size, "vocab_size": config.vocab_size}, {"block_size": "--context"})
        checkpoint.load(path, None, model, strict=False)
    except checkpoint.CheckpointError as e:        # a RuntimeError there; bad input here
        raise ValueError(f"--checkpoint {directory}: {e}") from None
    return path

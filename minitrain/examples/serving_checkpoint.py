"""The serving job's model from the gpt job's checkpoint: its sizes, precision and experts, then its weights.

As vLLM reads a model's configuration and dtype from its checkpoint, `generate --checkpoint DIR` takes
--context, --n-layer, --n-head, --n-embd and --precision from the newest checkpoint's manifest where
the command line leaves them out; given, they must be the checkpoint's (check_model names each that
differs). A --precision other than the checkpoint's is served as vLLM's --dtype and PyTorch's load_state_dict
serve it: the weights loaded at their own dtype, then cast to the serving one, which the job's report says; a
value the cast would overflow is refused. Without --checkpoint the job's own defaults apply.
The checkpoint is found once (ServedCheckpoint): a gpt job still saving cannot hand this job the sizes of
one checkpoint and the weights of the next.
"""
import os

import numpy as np

from minitrain import checkpoint
from minitrain.backend import array_module
from minitrain.checkpoint.storage import numpy_dtype
from minitrain.examples.checkpointing import check_model

#: option -> (the manifest's model key, the serving job's default without a checkpoint)
SIZES = {"context": ("block_size", 64), "n_layer": ("n_layer", 2), "n_head": ("n_head", 4), "n_embd": ("n_embd", 64)}
DEFAULT_PRECISION = "fp64"


class ServedCheckpoint:
    """The newest complete checkpoint in ``directory``, found and its manifest read once, at start-up: the
    sizes, the experts and the weights all come from that one, even while the gpt job goes on saving
    newer ones. path None where there is none or it cannot be read (``error`` says why; load_checkpoint
    reports it, after the options are checked)."""

    def __init__(self, directory):
        self.directory, self.path, self.layout, self.error, self.dtypes = directory, None, {}, None, set()
        if not os.path.isdir(directory):
            self.error = f"--checkpoint {directory}: " + ("a file, not a directory" if os.path.exists(directory)
                                                         else "no such directory")
            return
        try:
            self.path = checkpoint.find_latest(directory)
            if self.path is None:
                self.error = f"no checkpoint in {directory}"
            else:
                manifest = checkpoint.read_manifest(self.path)
                self.layout = manifest.get("layout", {})
                self.dtypes = {spec["dtype"] for key, spec in manifest.get("tensors", {}).items()
                               if key.startswith("model/")}
        except checkpoint.CheckpointError as e:        # a RuntimeError there; bad input here
            self.path, self.error = None, f"--checkpoint {directory}: {e}"
        if self.layout.get("job", "gpt") != "gpt":
            self.path, self.error = None, (f"--checkpoint {directory}: {self.path} was saved by the "
                                           f"{self.layout['job']} job; this job serves the gpt job's checkpoints")


def fill_model_options(args):
    """The options the command line left out (None): the checkpoint's where --checkpoint names one, else
    the job's defaults. Sets args.served (the ServedCheckpoint, or None)."""
    args.served = ServedCheckpoint(args.checkpoint) if args.checkpoint else None
    saved = args.served.layout if args.served else {}
    for option, (key, default) in SIZES.items():
        if getattr(args, option) is None:
            setattr(args, option, saved.get("model", {}).get(key, default))
    if args.precision is None:
        args.precision = saved.get("precision", DEFAULT_PRECISION)


def checkpoint_experts(served):
    """The mixture of experts the gpt job saved (--moe-experts, --moe-top-k, --moe-every from the
    manifest of ``served``, a ServedCheckpoint), served dropless: a capacity drops tokens by what else is
    in the batch, so the same prompt would continue differently beside other prompts (Mixtral and vLLM
    serve without one). {} for a dense model or no checkpoint (load_checkpoint says so)."""
    model = served.layout.get("model", {}) if served else {}
    if not model.get("moe_experts"):
        return {}
    return {key: model[key] for key in ("moe_experts", "moe_top_k", "moe_every", "moe_aux_loss_coef") if key in model}


def load_checkpoint(model, served):
    """Load the checkpoint ``served`` pinned (a ServedCheckpoint) into ``model`` (same
    --n-layer/--n-head/--n-embd, and --context = the gpt job's --block-size), parameters only: any layout
    the gpt job saved from (dp, tp, pp) is resharded to this one process. Weights saved in another dtype are
    read at theirs and cast to the model's. Returns what was loaded, for the report: the path, and the cast
    where there was one."""
    if served.path is None:
        raise ValueError(served.error)
    config = model.config
    serving = next(iter(model.parameters())).dtype
    saved = numpy_dtype(next(iter(served.dtypes))) if len(served.dtypes) == 1 else serving
    try:
        check_model(served.layout, {
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "block_size": config.block_size, "vocab_size": config.vocab_size}, {"block_size": "--context"})
        checkpoint.load(served.path, None, model.to(saved), strict=False)
    except checkpoint.CheckpointError as e:        # a RuntimeError there; bad input here
        raise ValueError(f"--checkpoint {served.directory}: {e}") from None
    if saved == serving:
        return served.path
    for name, q in model.named_parameters():
        xp = array_module(q.data)
        with np.errstate(over="ignore"):                # the overflow is what is looked for
            overflows = not xp.isfinite(q.data.astype(serving)).all() and xp.isfinite(q.data).all()
        if overflows:
            raise ValueError(f"--checkpoint {served.directory}: {name} holds {float(xp.abs(q.data).max()):.3g}, "
                             f"beyond {serving.name}'s range: serve it at the checkpoint's precision "
                             f"(--precision {served.layout.get('precision')})")
    model.to(serving)
    return f"{served.path}, its {saved.name} weights cast to {serving.name}"

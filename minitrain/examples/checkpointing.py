"""The jobs' checkpoint options: --save-dir DIR, --save-every N, --resume.

What the jobs decide (README, "Checkpoints"):
* A save happens after optimizer.step() (and the LR scheduler's step) of a step; the checkpoint's
  step is the number of completed steps, so a resumed job runs step step next. --save-every
  N saves after every N-th step counted from the start of training, and the last step is always saved.
* --resume takes the newest complete checkpoint in DIR (by the manifests' steps). An empty or
  missing DIR starts from step 0, saying so; step folders that lost their manifest are refused, by
  name. Without --resume, a DIR that already holds step folders is refused: a save never writes into
  an existing step folder. --epochs / --steps count from the start of training: a resumed job runs
  only what remains.
* The manifest records the model's configuration; another architecture is refused by name. It also
  records the schedule and optimizer settings (--steps, --lr, --lr-schedule, --warmup-steps, --seed; fp16's
  --init-scale, since the loss scale a resume continues with is the checkpoint's):
  a resume whose command line differs says which and stops, unless it gives Megatron-LM's
  --override-opt-param-scheduler (this command line's values: --steps 16 after an 8-step cosine run
  decays over 16 steps) or --use-checkpoint-opt-param-scheduler (the checkpoint's schedule, learning
  rate and seed; --steps still says how long to train).
* The layout may change (world size, dp x pp x tp, ZeRO stage, schedule). What cannot carry over is
  refused before anything is loaded: another job or precision, another optimizer, another global
  batch (the data order is the global batch's), local SGD's per-replica optimizer states on another
  layout, PipeDream-2BW's stashed weights W(t-1) under another schedule.
* A --save-dir no save could write into (a file, or a file above it; a read-only file system) is refused
  while parsing, before the steps it was meant to keep.
"""
import sys

import numpy as np

from .. import checkpoint, cli, random
from ..checkpoint import CheckpointError

#: the schedule and optimizer settings a resume compares with the checkpoint's, by option
TRAINING = {"steps": "--steps", "lr": "--lr", "lr_schedule": "--lr-schedule", "warmup_steps": "--warmup-steps",
            "seed": "--seed", "sync_every": "--sync-every", "init_scale": "--init-scale"}
#: the model's shape, by the option that sets it (the manifest's layout: "sizes", "model")
ARCHITECTURE = {"sizes": "--hidden / --layers", "vocab_size": "the corpus", "block_size": "--block-size",
                "n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "moe_experts": "--moe-experts",
                "moe_top_k": "--moe-top-k", "moe_capacity_factor": "--moe-capacity-factor", "moe_every": "--moe-every",
                "moe_aux_loss_coef": "--moe-aux-loss-coef", "moe_groups": "--moe-groups"}
LATER = ("sizes", "vocab_size", "moe_groups")     # known once the job has built its model or mesh
OVERRIDE, USE_CHECKPOINT = "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"


def add_arguments(parser):
    """The checkpoint options, after the job's own (their help names the job's schedule options)."""
    settings = [option for option in TRAINING.values() if option in parser._option_string_actions]
    length = "--steps" if "--steps" in settings else "--epochs"
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--save-dir", type=cli.output_folder, metavar="DIR",
                       help="save sharded checkpoints in DIR (DIR/step-NNNNNNNN; default: no checkpoints)")
    group.add_argument("--save-every", type=cli.positive_int, metavar="N", help="save after every N steps and after the last (default: after the last only)")
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in --save-dir, on any layout "
                            "(none there: start from step 0)")
    which = group.add_mutually_exclusive_group()
    which.add_argument(OVERRIDE, action="store_true",
                       help=f"with --resume: train with this command line's {', '.join(settings[:-1])} and "
                            f"{settings[-1]} where they differ from the checkpoint's")
    which.add_argument(USE_CHECKPOINT, action="store_true",
                       help="with --resume: keep the checkpoint's schedule, learning rate and seed (fp16: its "
                            "loss scale)"
                            + (" (and local SGD's --sync-every)" if "--sync-every" in settings else "")
                            + f" where this command line's differ ({length} still says how long to train)")


def check_arguments(parser, args):
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir DIR (where the checkpoints are)")
    if args.save_every is not None and not args.save_dir:
        parser.error("--save-every needs --save-dir DIR")
    for option in (OVERRIDE, USE_CHECKPOINT):
        if getattr(args, option[2:].replace("-", "_")) and not args.resume:
            parser.error(f"{option} needs --resume (it says which settings a resumed run takes)")


def training_settings(args):
    """This run's schedule and optimizer settings, as the manifest records them (--sync-every under local SGD alone:
    its averaging period; the other strategies average every step, and leave the option unused)."""
    settings = {key: getattr(args, key) for key in TRAINING if hasattr(args, key)}
    if getattr(args, "strategy", None) != "local_sgd":
        settings.pop("sync_every", None)
    if getattr(args, "precision", None) != "fp16":      # the only precision that scales its loss
        settings.pop("init_scale", None)
    return settings


def _differences(saved, mine):
    return [key for key in TRAINING if key in saved and key in mine and saved[key] != mine[key]]


def check_resume(parser, args, job):
    """Before any work (call it once the job's defaults are resolved): refuse a --save-dir that holds step
    folders without --resume, damaged step folders, another job's checkpoint, and settings that differ from the
    checkpoint's unless an option says which to take (--use-checkpoint-opt-param-scheduler copies the
    checkpoint's into args). ``job``: this job's name, as its layout records it. Returns the checkpoint's layout
    ({} where none is resumed)."""
    if not args.save_dir:
        return {}
    try:
        if not args.resume:
            existing = checkpoint.step_folders(args.save_dir)
            if existing:
                parser.error(f"--save-dir {args.save_dir} already holds {', '.join(existing[:3])}"
                             f"{', ...' if len(existing) > 3 else ''}: give --resume to continue from its newest "
                             f"checkpoint, or another --save-dir (a save never writes into an existing step folder)")
            return {}
        path = checkpoint.latest(args.save_dir)
        manifest = checkpoint.read_manifest(path) if path else {}
        saved = manifest.get("scalars", {}).get("job", {}).get("training")
    except CheckpointError as e:
        parser.error(f"--resume: {e}")
    layout = manifest.get("layout", {})
    saved_job = layout.get("job")
    if saved_job and saved_job != job:       # named first: its optimizer and settings are another job's
        parser.error(f"--resume: {path} was saved by the {saved_job} job, not this {job} job: resume it with "
                     f"python -m minitrain.examples.{saved_job}, or give this job another --save-dir")
    # another architecture, named before the settings (no override can make it fit): the options that are the
    # model's fields as they are (the rest, resolved later, is checked again when the model loads)
    mine = {key: getattr(args, key) for key in ARCHITECTURE if key not in LATER and hasattr(args, key)}
    try:
        check_model(layout, mine)
    except CheckpointError as e:
        parser.error(f"--resume: {path}: {e}")
    optimizer = layout.get("optimizer")
    if optimizer and getattr(args, "optimizer", optimizer) != optimizer:      # named first: --lr's default follows it
        parser.error(f"--resume: {path} was trained with --optimizer {optimizer} (this command line: "
                     f"{args.optimizer}): its optimizer state cannot carry over; resume with --optimizer {optimizer}")
    differ = _differences(saved or {}, training_settings(args))
    if not differ or args.override_opt_param_scheduler:
        return layout
    if args.use_checkpoint_opt_param_scheduler:
        for key in differ:
            if key != "steps":                   # the loaded scheduler keeps the saved schedule's length
                setattr(args, key, saved[key])
        return layout
    parser.error(f"--resume: {path} was trained with " + ", ".join(
        f"{TRAINING[key]} {saved[key]} (this command line: {getattr(args, key)})" for key in differ)
        + f": give {OVERRIDE} to train with this command line's values, or {USE_CHECKPOINT} to keep the "
          f"checkpoint's")


def _architecture(layout):
    return {**(layout.get("model") or {}), **({"sizes": layout["sizes"]} if "sizes" in layout else {})}


def check_model(saved_layout, mine, options=None):
    """Raise CheckpointError naming each setting of the model that differs from the checkpoint's."""
    saved, options = _architecture(saved_layout), {**ARCHITECTURE, **(options or {})}
    differ = [key for key in ARCHITECTURE if key in saved and key in mine and saved[key] != mine[key]]
    if differ:
        raise CheckpointError("the checkpoint's model has " + ", ".join(
            f"{key} = {saved[key]} ({options[key]}), this one {mine[key]}" for key in differ)
            + ": another architecture; give the checkpoint's values")


#: layout entries a resumed job must share with the checkpoint, and why
MUST_MATCH = {"job": "the checkpoint is another job's",
              "precision": "the tensors' dtypes differ",
              "optimizer": "the optimizer state differs",
              "global_batch_size": "the data order depends on the global batch",
              "block_size": "the data windows depend on it"}


def check_layout(saved, layout):
    """Raise CheckpointError if a job laid out as ``layout`` cannot continue from ``saved``."""
    for key, why in MUST_MATCH.items():
        if key in saved and key in layout and saved[key] != layout[key]:
            raise CheckpointError(f"the checkpoint was saved with {key} = {saved[key]!r}, this job has {layout[key]!r} "
                                  f"({why}): resume with the same {key}")
    check_model(saved, _architecture(layout))
    if saved.get("strategy") == "local_sgd" and (layout.get("strategy") != "local_sgd"
                                                 or layout["world_size"] != saved["world_size"]):
        raise CheckpointError(f"the checkpoint was saved by local SGD on {saved['world_size']} ranks: each replica's "
                              f"optimizer state is its own (each rank stepped on its own gradients), so it resumes "
                              f"only as local SGD on {saved['world_size']} ranks")
    if saved.get("schedule") == "pipedream_2bw" and layout.get("schedule") != "pipedream_2bw":
        raise CheckpointError("the checkpoint holds PipeDream-2BW's stashed weights W(t-1), which the next step "
                              "computes on; only --strategy pipeline --schedule pipedream_2bw can continue it")


def data_rng(rng):
    """extra= and restore= for a job that draws its batches from ``rng``: a resumed run draws the
    batches the uninterrupted run draws next."""
    def restore(saved):
        rng.bit_generator.state = saved["data_rng"]
    return {"extra": lambda: {"data_rng": rng.bit_generator.state}, "restore": restore}


def data_loader(loader):
    """extra= and restore= for a job that reads a DataLoader: its epoch, position and order."""
    return {"extra": lambda: {"loader": loader.state_dict()},
            "restore": lambda saved: loader.load_state_dict(saved["loader"])}


class Checkpointer:
    """Resume and save for one job: ``start_step()`` (or ``resume()``) once before training,
    ``after_step(step)`` after each step. ``extra()``: the job's own state saved beside the model
    (the data's position); ``restore(saved)`` puts it back on resume."""

    def __init__(self, args, comm, model, optimizer, scheduler=None, layout=None, extra=lambda: None,
                 optimizer_key="optimizer", restore=lambda saved: None):
        self.args, self.comm, self.model, self.optimizer, self.scheduler = args, comm, model, optimizer, scheduler
        self.layout, self.optimizer_key, self.restore = layout or {}, optimizer_key, restore
        self.extra = lambda: {**(extra() or {}), "training": training_settings(args)}
        self.last_saved = self.loaded = None
        self.rank = 0 if comm is None else comm.rank

    def say(self, message):
        if self.rank == 0:
            print(message, flush=True)

    def resume(self, optimizer_key=None):
        """Load the newest checkpoint if ``--resume``: returns ``checkpoint.Loaded`` or None (fresh start).
        ``optimizer_key``: a function of the saved layout giving the optimizer's namespace."""
        if not self.args.resume:
            return None
        path = checkpoint.find_latest(self.args.save_dir, self.comm)
        if path is None:
            self.say(f"--resume: no checkpoint in {self.args.save_dir}: starting from step 0")
            return None
        saved = checkpoint.read_manifest(path).get("layout", {})
        check_layout(saved, self.layout)
        if optimizer_key is not None:
            self.optimizer_key = optimizer_key(saved)
        fresh = self.scheduler.state_dict() if self.scheduler is not None else None
        loaded = checkpoint.load(path, self.comm, self.model, self.optimizer, self.scheduler, layout=self.layout,
                                 optimizer_key=self.optimizer_key)
        self.last_saved = loaded.step
        if getattr(self.args, "override_opt_param_scheduler", False):
            self.override(loaded, fresh)
        self.say(f"resumed from {path}: step {loaded.step}, saved by {checkpoint.describe_layout(saved)}")
        return loaded

    def start_step(self, optimizer_key=None):
        """The step training starts from: 0, or with --resume the checkpoint's, its extra state
        restored. Raises CheckpointError (the job ends with checkpointing.fail)."""
        self.loaded = loaded = self.resume(optimizer_key)
        if loaded is None:
            return 0
        self.restore(loaded.extra)
        return loaded.step

    def override(self, loaded, fresh):
        """--override-opt-param-scheduler: the loaded state continues under this command line's settings."""
        differ = _differences(loaded.extra.get("training", {}), training_settings(self.args))
        if self.scheduler is not None and set(differ) - {"seed"}:
            # the schedule's settings and base learning rate are this run's; its position (last_epoch) the checkpoint's
            state = self.scheduler.state_dict()
            state.update(base_lrs=fresh["base_lrs"], lr_lambdas=fresh["lr_lambdas"])
            self.scheduler.load_state_dict(state)
            for group, base, lr in zip(self.optimizer.param_groups, fresh["base_lrs"], self.scheduler.get_lr()):
                group.update(initial_lr=base, lr=lr)
            self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        elif "lr" in differ:
            for group in self.optimizer.param_groups:
                group["lr"] = self.args.lr
        if "init_scale" in differ:    # fp16's loss scale starts again from this command line's, as a fresh run's
            scaler = getattr(self.model, "scaler", None) or self.optimizer       # GPT3D's, or the job's own
            scaler.reset_loss_scale(self.args.init_scale)
        if "seed" in differ:          # the new seed draws what comes next: dropout masks and the data order
            seeds = np.random.SeedSequence([self.args.seed, loaded.step])
            random.manual_seed(int(seeds.generate_state(1)[0]))
            if "data_rng" in loaded.extra:
                loaded.extra["data_rng"] = np.random.default_rng(seeds).bit_generator.state
            if "loader" in loaded.extra:
                loaded.extra["loader"] = {**loaded.extra["loader"], "seed": self.args.seed}
        self.say(f"--override-opt-param-scheduler: {', '.join(TRAINING[k] for k in differ) or 'nothing'} "
                 f"from this command line")

    def due(self, step):
        every = self.args.save_every
        return bool(self.args.save_dir) and every is not None and step % every == 0 and step != self.last_saved

    def save(self, step):
        """Save ``step``'s checkpoint; a save that fails (a full disk, a folder made read-only) ends the job on every
        rank with one line naming the rank, the file and the cause, exit status 1: write_checkpoint gathers every
        rank's outcome, so all of them raise the same CheckpointError and none is left waiting in a collective."""
        try:
            path = checkpoint.save(self.args.save_dir, self.comm, step, self.model, self.optimizer, self.scheduler,
                                   extra=self.extra(), layout=self.layout, optimizer_key=self.optimizer_key)
        except CheckpointError as e:
            raise SystemExit(fail(self.comm, e, status=1)) from None
        self.last_saved = step
        return path

    def after_step(self, step):
        """Call after the optimizer (and scheduler) step that completes ``step`` steps."""
        if self.due(step):
            self.save(step)

    def finish(self, step):
        """After the last step: save it unless it was just saved (or nothing ran)."""
        if self.args.save_dir and step != self.last_saved:
            self.save(step)


def fail(comm, error, status=2):
    """Every rank got the same CheckpointError: rank 0 says it; the job exits with ``status`` (2: a checkpoint this
    command line cannot resume; 1: a save that failed)."""
    if comm is None or comm.rank == 0:
        sys.stderr.write(f"error: {error}\n")
        sys.stderr.flush()
    return status

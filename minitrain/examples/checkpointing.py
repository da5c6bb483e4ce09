"""The jobs' checkpoint options: --save-dir DIR, --save-every N, --resume.

What the jobs decide (README, "Checkpoints"):
* A save happens after optimizer.step() (and the LR scheduler's step) of a step; the checkpoint's
  step is the number of completed steps, so a resumed job runs step step next. --save-every
  N saves after every N-th step counted from the start of training, and the last step is always saved.
* --resume takes the newest complete checkpoint in DIR (by the manifests' steps). An empty or
  missing DIR starts from step 0, saying so. --epochs / --steps count from the start of
  training: a resumed job runs only what remains.
* The layout may change (world size, dp x pp x tp, ZeRO stage, schedule). What cannot carry over is
  refused before anything is loaded: another job or precision, another optimizer, another global
  batch (the data order is the global batch's), local SGD's per-replica optimizer states on another
  layout, PipeDream-2BW's stashed weights W(t-1) under another schedule.
"""
import sys

from .. import checkpoint, cli
from ..checkpoint import CheckpointError


def add_arguments(parser):
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--save-dir", metavar="DIR", help="save sharded checkpoints in DIR (DIR/step-NNNNNNNN; default: no checkpoints)")
    group.add_argument("--save-every", type=cli.positive_int, metavar="N", help="save after every N steps and after the last (default: after the last only)")
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in --save-dir, on any layout "
                            "(none there: start from step 0)")


def check_arguments(parser, args):
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir DIR (where the checkpoints are)")
    if args.save_every is not None and not args.save_dir:
        parser.error("--save-every needs --save-dir DIR")
    if args.save_every is not None and args.save_every < 1:
        parser.error("--save-every must be >= 1")


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
    if saved.get("strategy") == "local_sgd" and (layout.get("strategy") != "local_sgd"
                                                 or layout["world_size"] != saved["world_size"]):
        raise CheckpointError(f"the checkpoint was saved by local SGD on {saved['world_size']} ranks: each replica's "
                              f"optimizer state is its own (each rank stepped on its own gradients), so it resumes "
                              f"only as local SGD on {saved['world_size']} ranks")
    if saved.get("schedule") == "pipedream_2bw" and layout.get("schedule") != "pipedream_2bw":
        raise CheckpointError("the checkpoint holds PipeDream-2BW's stashed weights W(t-1), which the next step "
                              "computes on; only --strategy pipeline --schedule pipedream_2bw can continue it")


class Checkpointer:
    """Resume and save for one job: ``resume()`` once before training, ``after_step(step)`` after each step."""

    def __init__(self, args, comm, model, optimizer, scheduler=None, layout=None, extra=lambda: None,
                 optimizer_key="optimizer"):
        self.args, self.comm, self.model, self.optimizer, self.scheduler = args, comm, model, optimizer, scheduler
        self.layout, self.extra, self.optimizer_key = layout or {}, extra, optimizer_key
        self.last_saved = None
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
        loaded = checkpoint.load(path, self.comm, self.model, self.optimizer, self.scheduler, layout=self.layout,
                                 optimizer_key=self.optimizer_key)
        self.last_saved = loaded.step
        self.say(f"resumed from {path}: step {loaded.step}, saved by {checkpoint.describe_layout(saved)}")
        return loaded

    def due(self, step):
        every = self.args.save_every
        return bool(self.args.save_dir) and every is not None and step % every == 0 and step != self.last_saved

    def save(self, step):
        path = checkpoint.save(self.args.save_dir, self.comm, step, self.model, self.optimizer, self.scheduler,
                               extra=self.extra(), layout=self.layout, optimizer_key=self.optimizer_key)
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


def fail(comm, error):
    """Every rank got the same CheckpointError: rank 0 says it; the job exits with status 2."""
    if comm is None or comm.rank == 0:
        sys.stderr.write(f"error: {error}\n")
        sys.stderr.flush()
    return 2

"""A training state as logical tensors and scalars: what save writes and load reads back.

The checkpoint knows no strategy. It asks the model's wrapper where its parameters sit in the
logical tensors (sharded_parameters(): FSDP's flat shards, a pipeline stage's layers, GPT3D's
tensor-parallel slices; an object without it is a module whose parameters are whole, as under
DDP), and hands those placements to the optimizer, whose state arrays are cut the same way
(sharded_state_dict(placements)). Keys: model/<name>, optimizer/<name>/<state>
(exp_avg, momentum_buffer, fp32 master, ...); scalars: optimizer (hyper-parameters,
step counts, loss scale), scheduler, job (data position); each rank's random generator.
"""
import json

from .. import random
from ..sharded import whole
from .core import Reader, Scoped, all_gather_json, rank_and_size, write_checkpoint
from .manifest import describe_layout, latest, read_manifest
from .storage import CheckpointError


def sharded_parameters(model):
    """[(parameter, [(logical name, Slice)])] for every parameter this rank holds."""
    if hasattr(model, "sharded_parameters"):
        return model.sharded_parameters()
    module = getattr(model, "module", model)        # DistributedDataParallel, LocalSGD wrap a module
    return [(q, [(name, whole(q.shape))]) for name, q in module.named_parameters()]


def save(directory, comm, step, model, optimizer=None, scheduler=None, extra=None, layout=None,
         optimizer_key="optimizer", fsync=True, keep=None):
    """Collective: save the training state after ``step`` optimizer steps into ``directory/step-NNNNNNNN``
    (atomically; returns its path). ``extra``: the job's JSON scalars (data position, ...); ``layout``:
    a JSON description of how this job is laid out (recorded, shown by ``inspect``, compared on load)."""
    placements = sharded_parameters(model)
    tensors, scalars = {}, {}
    for q, pieces in placements:
        for name, s in pieces:
            tensors.setdefault(f"model/{name}", []).append((s, s.view(q.data)))
    by_id = {id(q): pieces for q, pieces in placements}
    if hasattr(model, "extra_sharded_state"):             # e.g. PipeDream-2BW's stashed weights
        for key, pieces in model.extra_sharded_state(by_id).items():
            tensors[f"model/{key}"] = pieces
    if optimizer is not None:
        state, scalars[optimizer_key] = optimizer.sharded_state_dict(by_id)
        for key, pieces in state.items():
            tensors[f"{optimizer_key}/{key}"] = pieces
    if scheduler is not None:
        scalars["scheduler"] = scheduler.state_dict()
    if extra is not None:
        scalars["job"] = extra
    return write_checkpoint(directory, comm, int(step), tensors, scalars, {"rng": random.get_state()}, layout,
                            fsync=fsync, keep=keep)


class Loaded:
    """What ``load`` found: ``step``, ``path``, ``layout`` (the saving job's), ``extra`` (its job scalars)."""

    def __init__(self, path, manifest):
        self.path, self.manifest = path, manifest
        self.step = int(manifest["step"])
        self.layout = manifest.get("layout", {})
        self.extra = manifest.get("scalars", {}).get("job", {})

    def __repr__(self):
        return f"Loaded(step={self.step}, path={self.path!r}, layout: {describe_layout(self.layout)})"


def load(path, comm, model, optimizer=None, scheduler=None, layout=None, strict=True, optimizer_key="optimizer"):
    """Collective: load the checkpoint in ``path`` into this rank's shards, whatever layout saved it
    (every rank reads only the pieces that intersect what it holds). Each rank gets its own random
    generator back when ``layout`` places every rank's draws as the saved one did (own_generators: another
    schedule or ZeRO stage does not move them), else rank 0's. ``strict``: every tensor
    in the checkpoint must be read by some rank (a tensor nobody asked for means another model or a
    state this layout cannot hold). Raises CheckpointError on every rank if any rank fails."""
    rank, size = rank_and_size(comm)
    manifest = read_manifest(path)
    reader = Reader(path, manifest)
    error = None
    try:
        placements = sharded_parameters(model)
        for q, pieces in placements:
            for name, s in pieces:
                reader.read_into(f"model/{name}", s, s.view(q.data))
        by_id = {id(q): pieces for q, pieces in placements}
        if hasattr(model, "load_extra_sharded_state"):
            model.load_extra_sharded_state(Scoped(reader, "model/"), by_id)
        scalars = manifest.get("scalars", {})
        if optimizer is not None:
            if optimizer_key not in scalars:
                raise CheckpointError(f"{path} holds no optimizer state under {optimizer_key!r} (it has "
                                      f"{sorted(scalars)}; saved by {describe_layout(manifest.get('layout'))})")
            optimizer.load_sharded_state_dict(Scoped(reader, optimizer_key + "/"), by_id, scalars[optimizer_key])
        if scheduler is not None:
            if "scheduler" not in scalars:
                raise CheckpointError(f"{path} holds no learning-rate scheduler state")
            scheduler.load_state_dict(scalars["scheduler"])
        saved = manifest["ranks"]
        same = len(saved) == size and own_generators(layout, manifest.get("layout"))
        random.set_state(saved[rank if same else 0]["rng"])
    except (CheckpointError, ValueError) as e:
        error = str(e)
    finally:
        reader.close()
    statuses = all_gather_json(comm, {"error": error, "read": sorted(reader.read_keys)})
    errors = [f"[rank {r}] {s['error']}" for r, s in enumerate(statuses) if s["error"]]
    if errors:
        raise CheckpointError(errors[0] + (f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""))
    if strict:
        read = set().union(*(s["read"] for s in statuses))
        unread = [k for k in manifest["tensors"] if k not in read]
        if unread:
            raise CheckpointError(f"{path}: no rank of this job reads {len(unread)} tensor(s) of the checkpoint "
                                  f"({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}): it was saved by "
                                  f"{describe_layout(manifest.get('layout'))}, which holds state this job has no "
                                  f"place for (another model or optimizer?)")
    return Loaded(path, manifest)


#: layout entries that change no rank's random draws: each rank still runs the same layers, experts and rows (a
#: schedule other than zbv's V places the stages as any other does and only reorders each stage's draws; ZeRO and
#: offload move state, not work; micro-batches cut the same rows), so its own generator continues the run
SAME_DRAWS = ("strategy", "schedule", "zero_stage", "offload", "microbatches")


def random_streams(layout):
    """What decides the random numbers each rank draws (dropout masks): the layout less SAME_DRAWS, plus where the
    schedule places the stages."""
    layout = layout or {}
    streams = {key: value for key, value in layout.items() if key not in SAME_DRAWS}
    streams["placement"] = "v" if layout.get("schedule") == "zbv" else "loop"
    return streams


def own_generators(layout, saved):
    """Whether each rank gets its own generator back: ``layout`` draws as ``saved`` did (random_streams). A
    manifest of an older version (fewer keys) is compared on its own keys, whole, as that version compared it
    (its strategy names what it lacks)."""
    if layout is None or saved is None:
        return False
    newer = set(layout) - set(saved)
    if newer:
        return _json({k: v for k, v in layout.items() if k not in newer}) == _json(saved)
    return _json(random_streams(layout)) == _json(random_streams(saved))


def _json(obj):
    return json.dumps(obj, sort_keys=True)


def find_latest(directory, comm=None):
    """The newest complete checkpoint under ``directory`` (or None), decided by rank 0 for everyone."""
    rank, _ = rank_and_size(comm)
    found = error = None
    if rank == 0:
        try:
            found = latest(directory)
        except CheckpointError as e:
            error = str(e)
    answer = all_gather_json(comm, {"path": found, "error": error})[0]
    if answer["error"]:
        raise CheckpointError(answer["error"])
    return answer["path"]

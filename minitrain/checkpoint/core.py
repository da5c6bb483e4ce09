"""Writing a sharded checkpoint from every rank at once, and reading any slice of it back.

Save (write_checkpoint), the steps of PyTorch's distributed checkpoint, on one shared directory:
1. plan: every rank lists the pieces it holds (tensor, global shape, dtype, box) and its scalars;
   one all-gather of that JSON gives every rank the same table;
2. deduplicate: a box several ranks hold (DDP replicas, tensor-parallel LayerNorms) is written
   once, by the holder with the fewest bytes assigned so far (biggest pieces first), so the replicas
   share the writing; each tensor's boxes must cover it exactly once (else a strategy lied);
3. write: each rank streams its pieces into rank-NNNNN.safetensors inside a temporary directory
   (no rank gathers anything but the table: a rank's extra memory is at most one piece);
4. commit: a second all-gather brings every file's CRC-32s to rank 0, which writes the manifest,
   renames the directory to step-NNNNNNNN and tells everyone. A kill before the manifest leaves
   a directory with no manifest, which latest ignores: the previous checkpoint stays the newest; a
   kill between the manifest and the rename leaves a complete checkpoint under its temporary name,
   which latest reads as what it is (the manifest is written only once every file's CRC-32 is in).

Load (Reader.read_into): a rank asks for the box its new layout holds; every saved piece that
intersects it is read (its bytes only, checked against their CRC-32, one piece in memory at a
time) and the intersection copied in. Any layout reads any other's checkpoint.
"""
import json
import math
import os
import re
import shutil
import tempfile
from collections import defaultdict

import numpy as np

from .. import backend
from ..sharded import box_index, intersect
from .manifest import TMP_PREFIX, describe_layout, list_checkpoints, write_manifest
from .storage import CheckpointError, RankFile, crc_hex, dtype_name, fsync_directory, numpy_dtype, write_rank_file


def rank_and_size(comm):
    return (0, 1) if comm is None else (comm.rank, comm.size)


def all_gather_json(comm, obj):
    """Every rank's JSON-able ``obj``, in rank order, on every rank (two small all-gathers)."""
    if comm is None or comm.size == 1:
        return [json.loads(json.dumps(obj))]
    from ..comm import ring_all_gather
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = ring_all_gather(comm, np.array([data.size], np.int64), total=comm.size)
    width = int(lengths.max())
    mine = np.zeros(width, np.uint8)
    mine[:data.size] = data
    table = ring_all_gather(comm, mine, total=width * comm.size).reshape(comm.size, width)
    return [json.loads(table[r, :int(lengths[r])].tobytes()) for r in range(comm.size)]


def merge_scalars(a, b, where="scalars"):
    """Union of two ranks' JSON scalars; a value both hold must agree (replicas hold one truth)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = merge_scalars(a[key], value, f"{where}/{key}") if key in a else value
        return out
    if a != b:
        raise CheckpointError(f"the ranks disagree about {where}: {a!r} vs {b!r}")
    return a


def rank_file(rank):
    return f"rank-{rank:05d}.safetensors"


def piece_key(key, offsets):
    return f"{key}@{','.join(map(str, offsets))}"


def plan_pieces(plans):
    """The tensors every rank holds, and which rank writes each distinct box."""
    specs, holders = {}, defaultdict(list)
    for rank, plan in enumerate(plans):
        for key, shape, dtype, offsets, sizes in plan["entries"]:
            spec = specs.setdefault(key, {"shape": shape, "dtype": dtype, "rank": rank})
            if (spec["shape"], spec["dtype"]) != (shape, dtype):
                raise CheckpointError(f"tensor {key}: rank {spec['rank']} holds it as {spec['dtype']}{tuple(spec['shape'])}, "
                                      f"rank {rank} as {dtype}{tuple(shape)}")
            holders[key, tuple(offsets), tuple(sizes)].append(rank)
    load, owner = [0] * len(plans), {}
    itemsize = {key: numpy_dtype(spec["dtype"]).itemsize for key, spec in specs.items()}
    for box in sorted(holders, key=lambda b: (-math.prod(b[2]) * itemsize[b[0]], b)):
        rank = min(holders[box], key=lambda r: (load[r], r))
        owner[box] = rank
        load[rank] += math.prod(box[2]) * itemsize[box[0]]
    covered = defaultdict(int)
    for key, _, sizes in owner:
        covered[key] += math.prod(sizes)
    for key, spec in specs.items():
        if covered[key] != math.prod(spec["shape"]):
            raise CheckpointError(f"tensor {key} {tuple(spec['shape'])}: the ranks' pieces cover {covered[key]} of its "
                                  f"{math.prod(spec['shape'])} elements (pieces overlap or leave a gap)")
    return specs, owner


def _raise_any(statuses, what):
    errors = [f"[rank {r}] {s['error']}" for r, s in enumerate(statuses) if s.get("error")]
    if errors:
        more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
        raise CheckpointError(f"{what}: {errors[0]}{more}")


def write_checkpoint(directory, comm, step, tensors, scalars, rank_scalars, layout, fsync=True, keep=None):
    """Collective: every rank passes its pieces ``{key: [(Slice, array)]}``; returns the new checkpoint's path."""
    rank, size = rank_and_size(comm)
    entries, local = [], {}
    for key, pieces in tensors.items():
        for s, array in pieces:
            if tuple(array.shape) != tuple(s.sizes):
                raise ValueError(f"{key}: the array's shape {tuple(array.shape)} is not the slice's {s.sizes}")
            if s.numel:
                entries.append([key, list(s.global_shape), dtype_name(array.dtype), list(s.offsets), list(s.sizes)])
                local[key, tuple(s.offsets), tuple(s.sizes)] = array
    tmp = error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step:08d}-", dir=directory)
        except OSError as e:
            error = f"cannot create a checkpoint in {directory}: {e}"
    plans = all_gather_json(comm, {"entries": entries, "scalars": scalars, "rank_scalars": rank_scalars,
                                   "tmp": tmp, "error": error})
    _raise_any(plans, f"saving step {step}")
    tmp = plans[0]["tmp"]
    try:
        specs, owner = plan_pieces(plans)
    except CheckpointError:                     # every rank raises it; rank 0 leaves no half-made folder behind
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    merged = {}
    for r, plan in enumerate(plans):
        merged = merge_scalars(merged, plan["scalars"])
    mine = [(piece_key(key, offsets), local[key, offsets, sizes])
            for (key, offsets, sizes), r in sorted(owner.items()) if r == rank]
    status = {}
    try:
        written, nbytes = write_rank_file(os.path.join(tmp, rank_file(rank)), mine, {"rank": rank, "step": step}, fsync)
        status = {"written": {k: [b, e, crc_hex(c)] for k, (b, e, c) in written.items()}, "bytes": nbytes}
    except (OSError, CheckpointError) as e:        # every rank learns it; nobody waits for a dead file
        status = {"error": f"writing {os.path.join(tmp, rank_file(rank))}: {e}"}
    results = all_gather_json(comm, status)
    path = error = None
    if rank == 0:
        try:
            if any(s.get("error") for s in results):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                path = _commit(directory, tmp, step, specs, owner, results, merged, plans, layout, size, keep)
        except (OSError, CheckpointError) as e:    # e.g. a full disk under the manifest: no .tmp-step left
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"committing {tmp}: {e}" if isinstance(e, OSError) else str(e)
    _raise_any(results, f"saving step {step}")
    final = all_gather_json(comm, {"path": path, "error": error})[0]
    _raise_any([final], f"saving step {step}")
    return final["path"]


def natural_key(key):
    """Model tensors first, then the rest; numbers in names compared as numbers (h.2 before h.10)."""
    parts = re.split(r"(\d+)", key)
    return (not key.startswith("model/"), [int(p) if p.isdigit() else p for p in parts])


def _commit(directory, tmp, step, specs, owner, results, scalars, plans, layout, size, keep):
    tensors = {key: {"shape": specs[key]["shape"], "dtype": specs[key]["dtype"], "pieces": []}
               for key in sorted(specs, key=natural_key)}
    counts = defaultdict(int)
    for (key, offsets, sizes), rank in sorted(owner.items()):
        begin, end, crc = results[rank]["written"][piece_key(key, offsets)]
        tensors[key]["pieces"].append({"file": rank_file(rank), "key": piece_key(key, offsets), "offsets": list(offsets),
                                       "sizes": list(sizes), "data_offsets": [begin, end], "crc32": crc})
        counts[rank] += 1
    files = {rank_file(r): {"rank": r, "bytes": s["bytes"], "pieces": counts[r]} for r, s in enumerate(results)}
    write_manifest(tmp, {"step": step, "world_size": size, "layout": layout or {}, "files": files, "tensors": tensors,
                         "scalars": scalars, "ranks": [p["rank_scalars"] for p in plans]})
    final = os.path.join(directory, f"step-{step:08d}")
    if os.path.exists(final):                   # never into (or over) a folder already there: another run's
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{final} already exists: a checkpoint is never written over another (resume from "
                              f"it with --resume, or save into another directory)")
    os.rename(tmp, final)
    fsync_directory(directory)
    if keep is not None:
        for _, _, path in list_checkpoints(directory)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    return final


class Reader:
    """Reads boxes of the logical tensors of the checkpoint in ``path`` (whatever layout saved it)."""

    def __init__(self, path, manifest):
        self.path, self.manifest = path, manifest
        self.tensors = manifest["tensors"]
        self.read_keys = set()
        self._files = {}
        self._cached = (None, None)              # the last piece read: (file key, array)

    def has(self, key):
        return key in self.tensors

    def keys(self, prefix=""):
        return [k for k in self.tensors if k.startswith(prefix)]

    def _file(self, name):
        if name not in self._files:
            self._files[name] = RankFile(os.path.join(self.path, name), self.manifest["files"][name]["bytes"])
        return self._files[name]

    def _piece(self, spec, piece):
        ident = (piece["file"], piece["key"])
        if self._cached[0] != ident:
            self._cached = (None, None)          # at most one piece in memory
            array = self._file(piece["file"]).read(piece["key"], numpy_dtype(spec["dtype"]), piece["sizes"],
                                                   piece["data_offsets"], piece["crc32"])
            self._cached = (ident, array)
        return self._cached[1]

    def read_into(self, key, s, out):
        """Fill ``out`` (numpy or cupy, shaped ``s.sizes``) with the box ``s`` of tensor ``key``."""
        spec = self.tensors.get(key)
        where = os.path.join(self.path, "manifest.json")
        if spec is None:
            raise CheckpointError(f"{where}: the checkpoint has no tensor {key} (it was saved by "
                                  f"{describe_layout(self.manifest.get('layout'))})")
        if tuple(spec["shape"]) != tuple(s.global_shape):
            raise CheckpointError(f"{where}: tensor {key} has shape {tuple(spec['shape'])} in the checkpoint, "
                                  f"{tuple(s.global_shape)} in this job: the checkpoint is from another model")
        if spec["dtype"] != dtype_name(out.dtype):
            raise CheckpointError(f"{where}: tensor {key} is {spec['dtype']} in the checkpoint, {dtype_name(out.dtype)} "
                                  f"in this job (saved with precision {self.manifest['layout'].get('precision')})")
        covered = 0
        for piece in spec["pieces"]:
            box = intersect(piece["offsets"], piece["sizes"], s.offsets, s.sizes)
            if box is None:
                continue
            try:
                src = self._piece(spec, piece)[box_index(*box, piece["offsets"])]
            except CheckpointError as e:
                raise CheckpointError(f"{e} (while reading tensor {key})") from None
            # on CuPy: the deliberate host -> device copy of what this rank needs
            out[box_index(*box, s.offsets)] = backend.to_device(src, "cuda") if backend.is_device_array(out) else src
            covered += math.prod(box[1])
        if covered != s.numel:
            raise CheckpointError(f"{where}: the pieces of {key} cover {covered} of the {s.numel} elements "
                                  f"this rank needs")
        self.read_keys.add(key)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cached = (None, None)


class Scoped:
    """The reader seen from one owner: keys relative to ``prefix`` (``optimizer/``, ``model/``)."""

    def __init__(self, reader, prefix):
        self.reader, self.prefix = reader, prefix

    def has(self, key):
        return self.reader.has(self.prefix + key)

    def keys(self, prefix=""):
        return [k[len(self.prefix):] for k in self.reader.keys(self.prefix + prefix)]

    def read_into(self, key, s, out):
        self.reader.read_into(self.prefix + key, s, out)

"""The manifest: what a checkpoint holds and where (PyTorch DCP's .metadata, as readable JSON).

DIR/step-00000040/manifest.json lists every logical tensor (global shape, dtype) and, for each
piece, the rank file that holds it, the box it covers (offsets, sizes), its bytes in that file and
their CRC-32; the layout that saved it (world size, dp x pp x tp, ZeRO stage, precision, ...); the
step (optimizer steps completed); the JSON scalars (optimizer hyper-parameters and step counts,
loss scale, LR scheduler, the job's data position) and each rank's random generator. Its own
CRC-32 covers everything else in it. It is written last, by rank 0, once every rank's file is on
disk: a directory with a valid manifest is a complete checkpoint, whatever its name.
"""
import json
import math
import os
import re
import time
import zlib

from .storage import CheckpointError, crc_hex, fsync_directory

FORMAT = "minitrain.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


def _body_crc(manifest):
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return crc_hex(zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()))


def write_manifest(directory, manifest):
    """Write ``manifest.json`` atomically (a temporary name, fsync, rename)."""
    manifest = dict(manifest, format=FORMAT, version=VERSION, created=time.time())
    manifest["checksum"] = _body_crc(manifest)
    path = os.path.join(directory, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_directory(directory)
    return manifest


def read_manifest(directory):
    """The manifest of the checkpoint in ``directory``, checked (format, version, its own checksum)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} is not a complete checkpoint: it has no {MANIFEST}")
    if not os.path.isfile(path):                  # a folder, or a pipe that would block the read forever
        raise CheckpointError(f"cannot read the checkpoint manifest {path}: it is not a file")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {path} is not valid JSON ({e}): the file is corrupt") from None
    except OSError as e:                          # no permission to read it, a folder in its place, ...
        raise CheckpointError(f"cannot read the checkpoint manifest {path}: {e.strerror or e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a minitrain checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('version')}; this code reads {VERSION}")
    if manifest.get("checksum") != _body_crc(manifest):
        raise CheckpointError(f"checkpoint manifest {path} fails its checksum (CRC-32 {_body_crc(manifest)}, "
                              f"recorded {manifest.get('checksum')}): the file is corrupt")
    return manifest


def list_checkpoints(directory, unreadable=None):
    """Every complete checkpoint under ``directory`` as (step, created, path), oldest first. A
    checkpoint is complete when its manifest exists; temporary directories of a save interrupted before
    its manifest have none and are skipped. The order comes from the manifests, never from directory names.
    A manifest that cannot be read raises CheckpointError, or with a list ``unreadable`` is appended
    to it as (path, the error) and the others are still listed."""
    found = []
    if not os.path.isdir(directory):
        return found
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
            try:
                manifest = read_manifest(path)
            except CheckpointError as e:
                if unreadable is None:
                    raise
                unreadable.append((path, e))
                continue
            found.append((int(manifest["step"]), float(manifest["created"]), path))
    return sorted(found)


def file_problems(directory, manifest=None):
    """What is wrong with the rank files of the checkpoint in ``directory``, found by their sizes alone
    (a partial copy, a lost or truncated file), one line each; [] where every file is there at its size.
    Their bytes are checked by reading them (``python -m minitrain.checkpoint verify``)."""
    manifest = manifest or read_manifest(directory)
    problems = []
    for name, info in sorted(manifest["files"].items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is {'not a file' if os.path.exists(path) else 'missing'}")
        elif os.path.getsize(path) != info["bytes"]:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, the manifest says {info['bytes']}")
    return problems


STEP_FOLDER = re.compile(r"step-\d+$")
#: a save writes into DIR/.tmp-step-NNNNNNNN-XXXX and renames it to step-NNNNNNNN once its manifest is in it
TMP_PREFIX = ".tmp-step-"


def step_folders(directory):
    """The step-NNNNNNNN folders under ``directory`` (complete or not), by name."""
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory)
                  if STEP_FOLDER.match(name) and os.path.isdir(os.path.join(directory, name)))


def unfinished_saves(directory):
    """The temporary folders under ``directory`` that have no manifest yet: a save still being written, or one
    interrupted before its manifest (never a checkpoint; a later save of the same step does not reuse them)."""
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory) if name.startswith(TMP_PREFIX)
                  and os.path.isdir(os.path.join(directory, name))
                  and not os.path.exists(os.path.join(directory, name, MANIFEST)))


def damaged_step_folders(directory):
    """The step folders without a manifest: a save renames its directory to step-NNNNNNNN only after the
    manifest is in it, so such a folder lost its manifest afterwards (never an interrupted save)."""
    return [name for name in step_folders(directory) if not os.path.exists(os.path.join(directory, name, MANIFEST))]


def latest(directory):
    """The path of the newest complete checkpoint under ``directory`` (most steps), or None.
    ``directory`` may also be a checkpoint itself. Step folders that lost their manifest are refused
    (CheckpointError naming them): which step is the newest is then unknown, and guessing could
    resume from an older state or overwrite the damaged folders."""
    if os.path.exists(os.path.join(directory, MANIFEST)):
        read_manifest(directory)
        return directory
    damaged = damaged_step_folders(directory)
    if damaged:
        one = len(damaged) == 1
        raise CheckpointError(f"{directory}: {', '.join(damaged)} {'has' if one else 'have'} no {MANIFEST} (not "
                              f"{'a complete checkpoint' if one else 'complete checkpoints'}), so the newest step is "
                              f"unknown; move {'it' if one else 'them'} out of {directory} (or resume from another "
                              f"directory)")
    found = list_checkpoints(directory)
    return found[-1][2] if found else None


def describe_layout(layout):
    if not layout:
        return "unknown layout"
    cp = f" x cp {layout['cp']}" if layout.get("cp", 1) > 1 else ""         # the mesh's order: dp x pp x cp x tp
    ep = f" (ep {layout['ep']} inside dp)" if layout.get("ep", 1) > 1 else ""
    parts = [f"{layout.get('job', '?')} job", f"strategy {layout.get('strategy', '?')}",
             f"{layout.get('world_size', '?')} rank(s) = dp {layout.get('dp', 1)} x pp {layout.get('pp', 1)}{cp} "
             f"x tp {layout.get('tp', 1)}{ep}"]
    if layout.get("zero_stage"):
        parts.append(f"ZeRO stage {layout['zero_stage']}")
    parts.append(f"precision {layout.get('precision', '?')}")
    return ", ".join(parts)


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def describe(directory, manifest=None):
    """The manifest as a table: tensors (shape, dtype, pieces, files, bytes), layout, step, files."""
    manifest = manifest or read_manifest(directory)
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest["created"]))
    lines = [f"checkpoint {directory}", f"step {manifest['step']} (optimizer steps completed), saved {created}",
             f"layout: {describe_layout(manifest.get('layout'))}",
             "  " + ", ".join(f"{k}={v}" for k, v in sorted(manifest.get("layout", {}).items()) if v is not None)]
    width = max([len(k) for k in manifest["tensors"]] + [6])
    lines.append(f"\n{'tensor':<{width}}  {'shape':<16} {'dtype':<9} {'pieces':>6} {'files':>5} {'bytes':>10}")
    total = 0
    for key, spec in manifest["tensors"].items():
        nbytes = sum(p["data_offsets"][1] - p["data_offsets"][0] for p in spec["pieces"])
        total += nbytes
        shape = "(" + ", ".join(map(str, spec["shape"])) + ("," if len(spec["shape"]) == 1 else "") + ")"
        files = len({p["file"] for p in spec["pieces"]})
        lines.append(f"{key:<{width}}  {shape:<16} {spec['dtype']:<9} {len(spec['pieces']):>6} {files:>5} "
                     f"{_fmt_bytes(nbytes):>10}")
    elements = sum(math.prod(s["shape"]) for s in manifest["tensors"].values())
    lines.append(f"\n{len(manifest['tensors'])} tensors, {elements:,} elements, {_fmt_bytes(total)} of data in "
                 f"{len(manifest['files'])} file(s):")
    for name, info in sorted(manifest["files"].items()):
        lines.append(f"  {name}  rank {info['rank']}  {_fmt_bytes(info['bytes'])}  "
                     f"{info['pieces']} piece(s)")
    for key, value in sorted(manifest.get("scalars", {}).items()):
        lines.append(f"scalars {key}: {_summary(value)}")
    return "\n".join(lines)


def _summary(value, width=110):
    """A scalar section in one line: the first levels of it, long lists and dicts shortened."""
    def short(v, depth):
        if isinstance(v, dict):
            if depth > 1 or len(v) > 6:
                return "{" + f"{len(v)} entries" + "}"
            return "{" + ", ".join(f"{k}: {short(x, depth + 1)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return f"[{len(v)} items]" if len(v) > 3 or depth > 1 else "[" + ", ".join(short(x, depth + 1) for x in v) + "]"
        return f"{v:.6g}" if isinstance(v, float) else repr(v)
    text = short(value, 0)
    return text if len(text) <= width else text[:width - 3] + "..."

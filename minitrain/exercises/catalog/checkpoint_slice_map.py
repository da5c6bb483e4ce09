"""Grader: real sharded checkpoints written by minitrain.checkpoint from ThreadWorld ranks (tensor-
parallel columns and rows, ZeRO-3 flat shards cut mid-row, replicas written once, a 3-D tensor and
a bias), read back into new layouts through the learner's slice map and compared, element for
element, with minitrain's own resharding (checkpoint.Reader.read_into). The tensors hold their own
row-major element numbers, so a wrong value says which element of the tensor landed there.
The layouts the cases save and load (which boxes each rank holds) are exercises/checkpoint_layouts.py's."""
import math
import shutil
import tempfile

import numpy as np

from ..checkpoint_layouts import along, flat, grid, replicated, whole
from ..comparing import compare
from ..grading import Check, Mismatch
from ..harness import run_ranks

TITLE = "a sharded checkpoint's slice map: which saved pieces fill a new layout's box"
ORDER = 185
KIND = "implement"
NOTEBOOK = "09_checkpoints"
DEFINES = "slice_map"

STUB = '''"""Exercise checkpoint_slice_map: load a sharded checkpoint into another layout (PyTorch's
distributed checkpoint; minitrain.checkpoint). The map from a new layout's slice to the saved pieces.

A checkpoint stores each logical tensor (what one process would hold, e.g. a (7, 5) weight) as
pieces: every rank of the saving job wrote the boxes it held into its rank file. A box is a block
of the tensor given by offsets (its first index along each axis) and sizes (its extent along each
axis); tensor parallelism saves column or row blocks, ZeRO-3 saves flat shards cut into boxes.
A job with another layout (another number of ranks, another strategy) loads by asking, on every
rank, for the box its own layout holds, and reading only the saved pieces that overlap it.

Write slice_map(pieces, offsets, sizes):
  pieces   the saved pieces of one tensor, as the manifest lists them: dicts with
             "file"     the rank file that holds it, e.g. "rank-00002.safetensors"
             "key"      the piece's name inside that file, e.g. "model/w@0,4"
             "offsets"  where the piece starts in the tensor (a list, one index per axis)
             "sizes"    its extent along each axis;
           the pieces cover the tensor exactly once.
  offsets, sizes   the box this rank's new layout holds (tuples, one entry per axis).
Return a list of reads (file, key, src, dst), one for each saved piece that overlaps the box:
  src   a tuple of slice objects, one per axis: the overlap, cut out of the piece's own array
        (an array of shape piece["sizes"]);
  dst   a tuple of slice objects: where the overlap goes in this rank's array (of shape sizes).
The loader then does mine[dst] = piece_array[src] for every read. A piece that does not overlap
the box is not read, not even as an empty slice.

The test to pass: checkpoints written by minitrain.checkpoint from 1 to 4 ranks (tensor-parallel
columns and rows, a 2 x 2 grid, ZeRO-3 flat shards cut in the middle of rows, replicas saved
once, a 3-D tensor and a bias of awkward sizes), loaded into other layouts through your map: every
new rank's box equals minitrain's own resharding (checkpoint.Reader.read_into) exactly, each
overlapping piece read once, no other piece read.

Check it:  python -m minitrain.exercises check checkpoint_slice_map mine.py
Stuck?     python -m minitrain.exercises hint checkpoint_slice_map
"""


def slice_map(pieces, offsets, sizes):
    raise NotImplementedError("slice_map: return [(file, key, src, dst)] for the pieces that overlap the box")
'''

HINTS = (
    "Work one axis at a time: a box is a product of one interval per axis, [offset, offset + size), "
    "and the overlap of two boxes is the product of the overlaps of their intervals. Two boxes overlap "
    "only if their intervals overlap along every axis.",
    "Along one axis, the overlap of [a, a + m) and [b, b + n) runs from the larger start to the smaller "
    "end, in the tensor's own indices. It is empty when that start is not below that end: touching "
    "blocks (one ends where the other begins) do not overlap, so skip that piece.",
    "src and dst are the same overlap counted from two different origins: src from the piece's first "
    "element (subtract piece['offsets'][axis]), dst from this rank's box (subtract offsets[axis]). "
    "So with lo = max(po, o) and hi = min(po + ps, o + s): src gets slice(lo - po, hi - po), dst gets "
    "slice(lo - o, hi - o), for every axis.",
)


# ---------------------------------------------------------------- one case: save, then load through the map
def _tensor(shape):
    return np.arange(math.prod(shape), dtype=np.float64).reshape(shape)


def _save(directory, tensors, saved_as):
    """minitrain.checkpoint writes ``tensors`` as the layout ``saved_as`` on ThreadWorld ranks."""
    from minitrain.checkpoint.core import write_checkpoint
    from minitrain.sharded import Slice, box_index
    per_rank = {key: saved_as(full.shape) for key, full in tensors.items()}
    ranks = len(next(iter(per_rank.values())))

    def body(comm):
        mine = {}
        for key, full in tensors.items():
            mine[key] = [(Slice(full.shape, o, s), full[box_index(o, s, (0,) * full.ndim)].copy())
                         for o, s in per_rank[key][comm.rank]]
        return write_checkpoint(directory, comm, 1, mine, {}, {}, {"exercise": "checkpoint_slice_map"}, fsync=False)
    return run_ranks(ranks, body)[0]


def _fmt_box(slices):
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in slices) + "]"


def _as_slices(value, bounds, what, owner):
    """The learner's src or dst as a tuple of (start, stop) slices within ``bounds``, or a Mismatch."""
    if not isinstance(value, (tuple, list)) or len(value) != len(bounds):
        raise Mismatch(f"{what} is {value!r:.80}; expected a tuple of {len(bounds)} slice objects, one per axis")
    out = []
    for axis, (s, n) in enumerate(zip(value, bounds)):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise Mismatch(f"{what}: axis {axis} is {s!r}; expected a slice(start, stop) with step 1")
        start, stop = 0 if s.start is None else s.start, n if s.stop is None else s.stop
        if not (isinstance(start, (int, np.integer)) and isinstance(stop, (int, np.integer))) or not 0 <= start <= stop <= n:
            raise Mismatch(f"{what}: axis {axis} is {start}:{stop}, outside 0:{n} ({owner} has {n} along axis {axis}): "
                           f"count from the first element of {owner}")
        out.append(slice(int(start), int(stop)))
    return tuple(out)


def _expected_read(piece, offsets, sizes):
    from minitrain.sharded import box_index, intersect
    box = intersect(piece["offsets"], piece["sizes"], offsets, sizes)
    return None if box is None else (box_index(*box, piece["offsets"]), box_index(*box, offsets))


def _describe_read(piece, src, dst):
    return (f"{piece['file']} / {piece['key']} (the piece at offsets {tuple(piece['offsets'])}, sizes "
            f"{tuple(piece['sizes'])}): src {_fmt_box(src)} -> dst {_fmt_box(dst)}")


def _load_box(impl, full, pieces, offsets, sizes, where):
    """The box assembled through the learner's map (NaN where nothing was written), and its reads."""
    given = [{"file": p["file"], "key": p["key"], "offsets": list(p["offsets"]), "sizes": list(p["sizes"])}
             for p in pieces]
    reads = impl(given, tuple(offsets), tuple(sizes))
    if not isinstance(reads, (list, tuple)):
        raise Mismatch(f"{where}: slice_map returned {type(reads).__name__}, expected a list of (file, key, src, dst)")
    by_key = {p["key"]: p for p in pieces}
    mine, seen = np.full(sizes, np.nan), {}
    for i, read in enumerate(reads):
        if not isinstance(read, (tuple, list)) or len(read) != 4:
            raise Mismatch(f"{where}: read #{i} is {read!r:.80}; expected a tuple (file, key, src, dst)")
        file, name, src, dst = read
        piece = by_key.get(name)
        if piece is None or piece["file"] != file:
            raise Mismatch(f"{where}: read #{i} names {file!r} / {name!r}, which is not one of the saved pieces "
                           "(copy a piece's 'file' and 'key')")
        src = _as_slices(src, piece["sizes"], f"{where}: the src of read #{i} ({name})", "the piece's array")
        dst = _as_slices(dst, sizes, f"{where}: the dst of read #{i} ({name})", "this rank's array")
        shape_src, shape_dst = tuple(s.stop - s.start for s in src), tuple(s.stop - s.start for s in dst)
        if shape_src != shape_dst:
            raise Mismatch(f"{where}: read #{i} copies a {shape_src} block of {name} into a {shape_dst} block: src and "
                           "dst must be the same overlap, counted from two origins")
        if 0 in shape_src:
            raise Mismatch(f"{where}: read #{i} is empty ({_describe_read(piece, src, dst)}): a piece that does not "
                           "overlap the box is not read at all. Blocks that only touch (one ends where the other "
                           "begins) do not overlap")
        if name in seen:
            raise Mismatch(f"{where}: {name} is read twice (reads #{seen[name]} and #{i}); one read per piece")
        seen[name] = i
        piece_array = full[tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["sizes"]))]
        mine[dst] = piece_array[src]
    return mine, {name: reads[i] for name, i in sorted(seen.items(), key=lambda item: item[1])}


def _diagnose(mine, want, full, pieces, reads, offsets, sizes):
    """Where the first wrong element's value came from: which piece holds it, which read wrote there."""
    wrong = np.argwhere(~(mine == want))
    if not wrong.size:
        return ""
    local = tuple(int(i) for i in wrong[0])
    glob = tuple(o + i for o, i in zip(offsets, local))
    by_key = {p["key"]: p for p in pieces}
    holder = next(p for p in pieces if all(o <= g < o + n for g, o, n in zip(glob, p["offsets"], p["sizes"])))
    src, dst = _expected_read(holder, offsets, sizes)
    text = f" That element is the tensor's {glob}, held by {holder['file']} / {holder['key']}."
    writers = [key for key, (_, _, _, d) in reads.items() if all(s.start <= i < s.stop for s, i in zip(d, local))]
    if not writers:
        if holder["key"] not in reads:
            return text + (" Nothing was written there: your map has no read from that piece, though it overlaps "
                           f"the box; it should read src {_fmt_box(src)} -> dst {_fmt_box(dst)}")
        _, _, got_src, got_dst = reads[holder["key"]]
        return text + (f" Nothing was written there: your read of that piece, src {_fmt_box(got_src)} -> dst "
                       f"{_fmt_box(got_dst)}, does not reach it; the overlap is src {_fmt_box(src)} -> dst {_fmt_box(dst)}")
    got = tuple(int(i) for i in np.unravel_index(int(mine[local]), full.shape))
    text += f" The tensor's elements are numbered in row-major order: you put its element {got} there"
    last = max(writers, key=lambda key: list(reads).index(key))
    piece, (_, _, got_src, got_dst) = by_key[last], reads[last]
    expected = _expected_read(piece, offsets, sizes)
    text += (f", with your read of {'that piece' if last == holder['key'] else piece['key']}: src {_fmt_box(got_src)} "
             f"-> dst {_fmt_box(got_dst)}. ")
    if expected is None:
        return text + f"That piece (offsets {tuple(piece['offsets'])}, sizes {tuple(piece['sizes'])}) does not overlap the box"
    return text + (f"The overlap of that piece (offsets {tuple(piece['offsets'])}, sizes {tuple(piece['sizes'])}) with "
                   f"this rank's box is src {_fmt_box(expected[0])} -> dst {_fmt_box(expected[1])}")


def _ranks(layouts, shape):
    """(rank, boxes, layout name) of every rank of every named new layout."""
    for name, layout in layouts:
        for rank, boxes in enumerate(layout(shape)):
            yield rank, boxes, name


def _case(impl, shapes, saved_as, loaded_as, label):
    """Save tensors of ``shapes`` as ``saved_as``; load every rank's boxes of ``loaded_as`` through the map."""
    from minitrain.checkpoint import Reader, read_manifest
    from minitrain.sharded import Slice
    tensors = {f"model/t{i}": _tensor(shape) for i, shape in enumerate(shapes)}
    directory = tempfile.mkdtemp(prefix="minitrain-exercise-")
    try:
        path = _save(directory, tensors, saved_as)
        manifest = read_manifest(path)
        reader = Reader(path, manifest)
        try:
            for key, full in tensors.items():
                pieces = manifest["tensors"][key]["pieces"]
                for rank, boxes, layout in _ranks(loaded_as, full.shape):
                    for offsets, sizes in boxes:
                        where = (f"{label}: tensor {key} {full.shape} loaded as {layout}, rank {rank}'s box "
                                 f"(offsets {offsets}, sizes {sizes})")
                        want = np.empty(sizes)
                        reader.read_into(key, Slice(full.shape, offsets, sizes), want)
                        mine, reads = _load_box(impl, full, pieces, offsets, sizes, where)
                        problem = compare(mine, want, f"{where} vs minitrain's Reader.read_into", exact=True)
                        if problem:
                            raise Mismatch(problem + "." + _diagnose(mine, want, full, pieces, reads, offsets, sizes))
                        extra = sorted(set(reads) - {p["key"] for p in pieces if _expected_read(p, offsets, sizes)})
                        if extra:
                            raise Mismatch(f"{where}: reads {extra}, which do(es) not overlap the box")
        finally:
            reader.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


CASES = (
    ("one process saved a (7, 5) weight whole; one process and rows over 2 load it",
     [(7, 5)], whole, [("one process", whole), ("rows over 2", along(0, 2))], 1),
    ("tensor parallel: columns over 3 ranks -> rows over 4 ranks", [(7, 5)], along(1, 3),
     [("rows over 4", along(0, 4))], 2),
    ("rows over 2 ranks -> columns over 3, and a 2 x 2 grid", [(13, 6)], along(0, 2),
     [("columns over 3", along(1, 3)), ("a 2 x 2 grid", grid(2, 2))], 2),
    ("rows over 4 ranks -> single rows: only the piece that holds a row is read", [(9, 3)], along(0, 4),
     [("rows over 9", along(0, 9))], 2),
    ("ZeRO-3 flat shards over 3 ranks, cut mid-row -> columns over 2, and flat shards over 4",
     [(5, 7)], flat(3), [("columns over 2", along(1, 2)), ("ZeRO-3 over 4", flat(4))], 3),
    ("data parallel x tensor parallel (2 x 2), replicas saved once -> rows over 3", [(6, 4)],
     replicated(2, along(1, 2)), [("rows over 3", along(0, 3))], 2),
    ("a (4, 3, 5) tensor and a bias of 13 saved by ZeRO-3 over 4 -> a 3 x 2 grid and flat shards over 5",
     [(4, 3, 5), (13,)], flat(4), [("a 3 x 2 grid", lambda shape: grid(3, 2)(shape) if len(shape) > 1 else []),
                                   ("ZeRO-3 over 5", flat(5))], 3),
)


def checks():
    return [Check(label, lambda f, c=(shapes, saved, loaded, label): _case(f, *c), hint)
            for label, shapes, saved, loaded, hint in CASES]


def reference():
    from minitrain.sharded import box_index, intersect

    def slice_map(pieces, offsets, sizes):
        reads = []
        for piece in pieces:              # minitrain.checkpoint.core.Reader.read_into's arithmetic
            box = intersect(piece["offsets"], piece["sizes"], offsets, sizes)
            if box is not None:
                reads.append((piece["file"], piece["key"], box_index(*box, piece["offsets"]),
                              box_index(*box, offsets)))
        return reads
    return slice_map

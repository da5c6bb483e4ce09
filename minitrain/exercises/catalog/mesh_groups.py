"""Grader: the device mesh's process groups (Megatron-LM's rank layout, Narayanan et al. 2021, sec. 3.3;
PyTorch's DeviceMesh): the world as arange(world).reshape(pp, dp, cp, tp), tp innermost, and each axis's
groups the ranks that differ only along it, in the axis's order; Megatron's joint dp x cp group too.
Compared with minitrain's DeviceMesh built on ThreadWorld, for eight shapes of up to 16 ranks."""
from ..grading import Check, Mismatch

TITLE = "the device mesh: which ranks form each tensor-, context-, data- and pipeline-parallel group"
ORDER = 175
KIND = "implement"
NOTEBOOK = "08_3d_parallel"
DEFINES = "mesh_groups"

STUB = '''"""Exercise mesh_groups: 3D (and 4D) parallelism lays the world's ranks out as a grid, and every
collective runs inside a group along one axis of it (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 3.3). minitrain's DeviceMesh, as
Megatron does, puts tensor parallelism innermost: its groups are adjacent ranks, which on a cluster
share a node and its fast links, since tensor parallelism talks inside every layer; then context
parallelism, then data parallelism, and pipeline parallelism outermost (it sends the least).

Write mesh_groups(pp, dp, cp, tp): every process group of a mesh of pp x dp x cp x tp ranks.

Contract:
  - the grid is arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp): rank r sits at the coordinates
    where the grid holds r;
  - return a dict with the keys "pp", "dp", "cp", "tp" and "dp_cp": for each, a list of groups, a
    group being the list of ranks (Python ints) that differ only in that axis's coordinate ("dp_cp":
    only in their dp and cp coordinates: the data-parallel group of context parallelism, over which
    gradients are averaged), every rank in exactly one group of each key;
  - within a group, ranks in the group's rank order: increasing coordinate along the axis (for
    "dp_cp", dp outer and cp inner); the groups themselves in any order.

The test to pass:
  - the tp groups of 2 x 2 x 1 x 2 (pp x dp x cp x tp) are adjacent ranks: [0, 1], [2, 3], ...;
  - every axis's groups, and dp_cp's, for eight shapes of 1 to 16 ranks, equal the ranks that
    minitrain's DeviceMesh, built on ThreadWorld, connects along that axis.

Check it:  python -m minitrain.exercises check mesh_groups mine.py
Stuck?     python -m minitrain.exercises hint mesh_groups
"""


def mesh_groups(pp, dp, cp, tp):
    raise NotImplementedError("mesh_groups: the grid, then the ranks along each axis")
'''

HINTS = (
    "grid = np.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp). The tp group of the rank at (s, d, c, t) "
    "is grid[s, d, c, :]: all four indices fixed but the one of the axis. Its dp group is grid[s, :, c, t].",
    "All the groups of one axis at once: move that axis to the end and cut the rest into rows, "
    "np.moveaxis(grid, axis, -1).reshape(-1, size): each row is one group, in the axis's order. A plain "
    "grid.reshape(-1, size) without moving the axis cuts consecutive ranks, which is right for tp only.",
    "dp_cp: move both axes to the end, dp before cp, np.moveaxis(grid, (1, 2), (-2, -1)).reshape(-1, dp * cp). "
    "Convert each row with [int(r) for r in row]: a group is a list of Python ints.",
)

SHAPES = [(1, 1, 1, 1), (1, 4, 1, 1), (1, 1, 1, 5), (2, 2, 1, 2), (2, 1, 2, 2), (3, 2, 1, 2), (1, 2, 2, 3),
          (2, 2, 2, 2)]                                 # (pp, dp, cp, tp)
KEYS = ("pp", "dp", "cp", "tp", "dp_cp")


def _library_groups(pp, dp, cp, tp):
    """{key: {rank: its group}} as minitrain's DeviceMesh on ThreadWorld connects them."""
    from ...comm import DeviceMesh, ThreadWorld
    per_rank = ThreadWorld(pp * dp * cp * tp).run(
        lambda comm: {k: DeviceMesh(comm, pp=pp, dp=dp, cp=cp, tp=tp).ranks_along(k) for k in KEYS})
    return {k: {r: groups[k] for r, groups in enumerate(per_rank)} for k in KEYS}


def _groups(impl, shape):
    """impl's groups as {key: {rank: group}}, checked for form: a dict of lists of lists of ints, a
    partition of the world."""
    pp, dp, cp, tp = shape
    world = pp * dp * cp * tp
    what = f"mesh_groups(pp={pp}, dp={dp}, cp={cp}, tp={tp})"
    got = impl(*shape)
    if not isinstance(got, dict) or set(got) != set(KEYS):
        raise Mismatch(f"{what} returned {type(got).__name__} with keys {sorted(got) if isinstance(got, dict) else '-'}, "
                       f"expected a dict with the keys {list(KEYS)}")
    out = {}
    for k in KEYS:
        try:
            groups = [[int(r) for r in g] for g in got[k]]
        except TypeError:
            raise Mismatch(f"{what}[{k!r}] is {got[k]!r:.80}, expected a list of groups, each a list of ranks") from None
        seen = sorted(r for g in groups for r in g)
        if seen != list(range(world)):
            missing, twice = sorted(set(range(world)) - set(seen)), sorted({r for r in seen if seen.count(r) > 1})
            raise Mismatch(f"{what}[{k!r}] = {groups}: every rank 0..{world - 1} belongs to exactly one group of an "
                           f"axis" + (f"; missing {missing}" if missing else "") + (f"; twice {twice}" if twice else ""))
        out[k] = {r: g for g in groups for r in g}
    return out, what


def _compare(impl, shape, keys):
    mine, what = _groups(impl, shape)
    library = _library_groups(*shape)
    for k in keys:
        for r in sorted(library[k]):
            if mine[k][r] != library[k][r]:
                axes = "its dp and cp coordinates (dp outer, cp inner)" if k == "dp_cp" else f"its {k} coordinate"
                raise Mismatch(f"{what}[{k!r}]: rank {r}'s group is {mine[k][r]}, expected {library[k][r]}: the ranks "
                               f"of grid = arange({shape[0] * shape[1] * shape[2] * shape[3]}).reshape(pp, dp, cp, tp) "
                               f"that differ from rank {r} only in {axes}, in that order")


def _tp_adjacent(impl):
    _compare(impl, (2, 2, 1, 2), ["tp"])


def _every_axis(impl):
    for shape in SHAPES:
        _compare(impl, shape, ["tp", "cp", "dp", "pp"])


def _dp_cp(impl):
    for shape in SHAPES:
        _compare(impl, shape, ["dp_cp"])


def checks():
    return [Check("tp innermost: the tensor-parallel groups are adjacent ranks", _tp_adjacent, 1),
            Check("every axis's groups, eight shapes, == minitrain's DeviceMesh on ThreadWorld", _every_axis, 2),
            Check("dp_cp, data parallelism's group under context parallelism, == DeviceMesh's", _dp_cp, 3)]


def reference():
    """The groups minitrain's DeviceMesh connects (on ThreadWorld), one list per axis."""
    def mesh_groups(pp, dp, cp, tp):
        library = _library_groups(pp, dp, cp, tp)
        return {k: [list(g) for g in {tuple(g) for g in library[k].values()}] for k in KEYS}
    return mesh_groups

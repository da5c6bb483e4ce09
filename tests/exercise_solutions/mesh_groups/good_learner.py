"""A learner's mesh_groups, written from the hints: the grid, each axis moved last and cut into rows."""
import numpy as np


def mesh_groups(pp, dp, cp, tp):
    grid = np.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
    groups = {}
    for axis, name in enumerate(("pp", "dp", "cp", "tp")):
        rows = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
        groups[name] = [[int(r) for r in row] for row in rows]
    rows = np.moveaxis(grid, (1, 2), (-2, -1)).reshape(-1, dp * cp)
    groups["dp_cp"] = [[int(r) for r in row] for row in rows]
    return groups

"""Lays the grid out with tp outermost: tensor-parallel partners land far apart."""
import numpy as np


def mesh_groups(pp, dp, cp, tp):
    grid = np.arange(pp * dp * cp * tp).reshape(tp, cp, dp, pp).transpose(3, 2, 1, 0)
    groups = {}
    for axis, name in enumerate(("pp", "dp", "cp", "tp")):
        rows = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
        groups[name] = [[int(r) for r in row] for row in rows]
    rows = np.moveaxis(grid, (1, 2), (-2, -1)).reshape(-1, dp * cp)
    groups["dp_cp"] = [[int(r) for r in row] for row in rows]
    return groups

EXPECT = ["['tp']: rank 0's group is [0, 4], expected [0, 1]"]

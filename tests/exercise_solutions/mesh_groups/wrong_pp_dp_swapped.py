"""Puts dp outermost and pp inside it: a pipeline's stages become neighbours in the grid."""
import numpy as np


def mesh_groups(pp, dp, cp, tp):
    grid = np.arange(pp * dp * cp * tp).reshape(dp, pp, cp, tp).transpose(1, 0, 2, 3)
    groups = {}
    for axis, name in enumerate(("pp", "dp", "cp", "tp")):
        rows = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
        groups[name] = [[int(r) for r in row] for row in rows]
    rows = np.moveaxis(grid, (1, 2), (-2, -1)).reshape(-1, dp * cp)
    groups["dp_cp"] = [[int(r) for r in row] for row in rows]
    return groups

EXPECT = ["['dp']: rank 0's group is [0, 4], expected [0, 2]"]

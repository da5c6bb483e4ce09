"""Joins dp and cp with cp outer: the right ranks in each group, in the wrong order."""
import numpy as np


def mesh_groups(pp, dp, cp, tp):
    grid = np.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
    groups = {}
    for axis, name in enumerate(("pp", "dp", "cp", "tp")):
        rows = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
        groups[name] = [[int(r) for r in row] for row in rows]
    rows = np.moveaxis(grid, (2, 1), (-2, -1)).reshape(-1, dp * cp)
    groups["dp_cp"] = [[int(r) for r in row] for row in rows]
    return groups

EXPECT = ["['dp_cp']: rank 0's group is [0, 6, 3, 9], expected [0, 3, 6, 9]", '(dp outer, cp inner)']

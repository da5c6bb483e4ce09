"""Cuts consecutive ranks for every axis (no moveaxis): right for tp, wrong for the others."""
import numpy as np


def mesh_groups(pp, dp, cp, tp):
    world = pp * dp * cp * tp
    ranks = np.arange(world)
    groups = {name: [[int(r) for r in row] for row in ranks.reshape(-1, size)]
              for name, size in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp), ("dp_cp", dp * cp))}
    return groups

EXPECT = ["['dp']: rank 0's group is [0, 1], expected [0, 2]", 'only in its dp coordinate']

"""Sums every rank's busy time over one wall: p ranks have p walls, so the bubble goes negative."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    return 1 - sum(a["compute"][1] - a["compute"][0] for acts in actions for a in acts) / wall

EXPECT = ['yours -0.06', '1 - (busy summed over ranks) / wall']

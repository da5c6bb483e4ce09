"""Takes a rank's busy time from its first compute's start to its last compute's end: the waits
between the computes count as work."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    s = [1 - (max(a["compute"][1] for a in acts) - min(a["compute"][0] for a in acts)) / wall for acts in actions]
    return sum(s) / len(s)

EXPECT = ["busy from the rank's first compute to its last"]

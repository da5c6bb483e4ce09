"""Ends the wall when rank 0 leaves: a rank that left later idled until then, and its time is cut off."""


def bubble_fraction(step_start, step_end, actions):
    wall = step_end[0] - step_start[0]
    s = [1 - sum(a["compute"][1] - a["compute"][0] for a in acts) / wall for acts in actions]
    return sum(s) / len(s)

EXPECT = ['ranks leaving at 9, 9.6 and 9.3', "the wall to rank 0's exit"]

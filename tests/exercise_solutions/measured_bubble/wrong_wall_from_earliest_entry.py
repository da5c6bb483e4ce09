"""Starts the wall at the earliest entry, min(step_start): a rank that entered before the first stage
waited for nothing of this step, yet its wait is counted."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - min(step_start)
    s = [1 - sum(a["compute"][1] - a["compute"][0] for a in acts) / wall for acts in actions]
    return sum(s) / len(s)

EXPECT = ['before the first stage', 'the wall from the earliest entry, min(step_start)']

"""Counts F and B only: a zero-bubble schedule's W, the weight gradients, is work too."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    s = [1 - sum(a["compute"][1] - a["compute"][0] for a in acts if a["kind"] != "W") / wall for acts in actions]
    return sum(s) / len(s)

EXPECT = ['W included', 'W left out']

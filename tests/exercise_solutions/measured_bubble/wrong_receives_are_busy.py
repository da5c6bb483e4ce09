"""Counts the receive spans as work: a receive waits for the neighbour's message, the bubble itself,
so the bubble comes out far too small."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    s = []
    for acts in actions:
        busy = sum(a["compute"][1] - a["compute"][0] for a in acts)
        busy += sum(a["receive"][1] - a["receive"][0] for a in acts if a["receive"])
        s.append(1 - busy / wall)
    return sum(s) / len(s)

EXPECT = ['the bubble is 0.47, yours 0.225', 'the receive spans counted as busy']

"""Returns the busy share, busy / wall, instead of the bubble."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    s = [sum(a["compute"][1] - a["compute"][0] for a in acts) / wall for acts in actions]
    return sum(s) / len(s)

EXPECT = ['yours 0.53', 'the busy share, not the bubble']

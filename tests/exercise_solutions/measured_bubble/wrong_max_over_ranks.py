"""Reports the worst rank's bubble instead of the mean over ranks."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    return max(1 - sum(a["compute"][1] - a["compute"][0] for a in acts) / wall for acts in actions)

EXPECT = ['yours 0.5', "the largest rank's bubble: the step's is the mean over ranks"]

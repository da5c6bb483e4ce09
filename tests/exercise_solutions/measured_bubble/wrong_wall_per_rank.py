"""Gives each rank its own wall, from its own entry to its own exit: a rank that entered late (still in
the previous step's optimizer) or left early looks less idle than the pipeline kept it."""


def bubble_fraction(step_start, step_end, actions):
    s = [1 - sum(a["compute"][1] - a["compute"][0] for a in acts) / (e - b) for acts, b, e in zip(actions, step_start, step_end)]
    return sum(s) / len(s)

EXPECT = ['rank 1 late at 1', 'the wall per rank, from its own entry to its own exit']

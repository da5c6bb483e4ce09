"""A learner's measured bubble, written from the contract: one wall from rank 0's entry to the last
exit, each rank's compute spans summed, the mean of 1 - busy / wall."""


def bubble_fraction(step_start, step_end, actions):
    wall = max(step_end) - step_start[0]
    shares = []
    for acts in actions:
        busy = sum(a["compute"][1] - a["compute"][0] for a in acts)
        shares.append(1 - busy / wall)
    return sum(shares) / len(shares)

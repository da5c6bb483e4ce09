"""A learner's 1F1B, written from the hints (tuples, not minitrain's Action objects)."""


def one_f_one_b(p, m):
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule

"""A learner's ZB-H1, written from the hints (tuples, not minitrain's Action objects): 1F1B's
forwards and input-gradient backwards, each stage's Ws postponed by its index, the rest at the end."""


def zb_h1(p, m):
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        owed = []
        for i in range(m):
            if warmup + i < m:
                actions.append(("F", warmup + i))
            actions.append(("B", i))
            owed.append(i)
            if i >= s:
                actions.append(("W", owed.pop(0)))
        schedule.append(actions + [("W", i) for i in owed])
    return schedule

"""W run first: each micro-batch's weight gradient is scheduled before its input gradient B."""


def zb_h1(p, m):
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                actions.append(("F", warmup + i))
            actions += [("W", i), ("B", i)]
        schedule.append(actions)
    return schedule

EXPECT = ['W0 (action #', 'comes before its input-gradient backward B', 'W(i) must come after B(i)']

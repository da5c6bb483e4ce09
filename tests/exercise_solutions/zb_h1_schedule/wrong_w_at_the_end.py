"""Every W postponed to the very end: the drain is filled, but every stage keeps all m micro-batches
in flight until then (GPipe's memory)."""


def zb_h1(p, m):
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                actions.append(("F", warmup + i))
            actions.append(("B", i))
        schedule.append(actions + [("W", i) for i in range(m)])
    return schedule

EXPECT = ['micro-batches in flight at the peak', 'at most min(p, m)', 'postpones its Ws too long']

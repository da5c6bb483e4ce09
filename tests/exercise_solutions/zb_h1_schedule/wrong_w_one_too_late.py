"""Each stage postpones its Ws by one more micro-batch than ZB-H1 (W(i) after B(i + s + 1)): the
drain is no better filled, and every stage holds one micro-batch more than the bound."""


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
            if i >= s + 1:
                actions.append(("W", owed.pop(0)))
        schedule.append(actions + [("W", i) for i in owed])
    return schedule

EXPECT = ['in flight at the peak, per stage: [2]', 'at most min(p, m) = 1', 'postpones its Ws too long']

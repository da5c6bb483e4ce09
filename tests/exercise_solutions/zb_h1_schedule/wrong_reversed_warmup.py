"""The warm-up reversed: stage s runs s forwards before its first B (the last stage the most, the
first none), so stage 0 waits for a gradient that stage 1 cannot send before stage 0's next forward."""


def zb_h1(p, m):
    schedule = []
    for s in range(p):
        warmup = min(s, m)
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

EXPECT = ['the schedule deadlocks', 'stage 0 waits at B0', 'wait for each other in a circle']

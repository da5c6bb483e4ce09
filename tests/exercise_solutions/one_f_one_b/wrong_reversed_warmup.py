"""The warm-up counts the wrong way round (s instead of p - s - 1): the first stages wait for each other."""


def one_f_one_b(p, m):
    schedule = []
    for s in range(p):
        warmup = min(s, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule

EXPECT = ['deadlocks', 'waits at']

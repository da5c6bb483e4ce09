"""One warm-up forward too many (p - s instead of p - s - 1): a micro-batch more in flight than 1F1B needs."""


def one_f_one_b(p, m):
    schedule = []
    for s in range(p):
        warmup = min(p - s, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule

EXPECT = ['in flight', '1F1B keeps at most']

"""No warm-up: every stage alternates F and B from the start, so the pipeline never fills."""


def one_f_one_b(p, m):
    schedule = []
    for s in range(p):
        warmup = 0
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule

EXPECT = ['bubble', 'expected (p-1)/(m+p-1)']

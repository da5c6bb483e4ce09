"""1F1B with the backward cut in two: each W right after its B, so no W is left to fill the drain."""


def zb_h1(p, m):
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                actions.append(("F", warmup + i))
            actions += [("B", i), ("W", i)]
        schedule.append(actions)
    return schedule

EXPECT = ['ZB-H1 idles (p-1)(F+B-W) = 1', 'Yours idles (p-1)(F+B) = 2', 'no W is left over to fill the drain']

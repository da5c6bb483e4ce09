"""The optimal dynamic programme without the free-layer rule: on ties it may give a stage nothing but
ReLUs (cost 0), which does no work and idles the whole step."""


def balanced_split_points(sizes, parts):
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], start[k][i] = cost, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = start[k][i]
        points.append(i)
    return sorted(points)[1:]

EXPECT = ["holds only layers of cost 0", "A stage of only ReLUs does no work and idles"]

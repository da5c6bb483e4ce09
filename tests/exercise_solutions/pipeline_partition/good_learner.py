"""A learner's linear partition, written from the contract: a dynamic programme over the prefix sums,
best[k][i] the first i layers in k groups, skipping groups of zeros while enough layers cost something."""


def balanced_split_points(sizes, parts):
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    paid = [0]
    for s in sizes:
        paid.append(paid[-1] + (1 if s > 0 else 0))
    avoid = paid[n] >= parts
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if avoid and paid[i] == paid[j]:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], start[k][i] = cost, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = start[k][i]
        points.append(i)
    return sorted(points)[1:]

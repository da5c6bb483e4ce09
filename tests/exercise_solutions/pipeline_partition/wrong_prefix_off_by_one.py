"""The right dynamic programme with the prefix sums read one layer off: group j..i-1 priced as
prefix[i + 1] - prefix[j + 1], layers j+1..i, so each layer is charged its right neighbour's cost."""


def balanced_split_points(sizes, parts):
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    prefix.append(prefix[-1])
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
                cost = max(best[k - 1][j], prefix[i + 1] - prefix[j + 1])
                if cost < best[k][i]:
                    best[k][i], start[k][i] = cost, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = start[k][i]
        points.append(i)
    return sorted(points)[1:]

EXPECT = ["the prefix sums are one layer off", "right neighbour's"]

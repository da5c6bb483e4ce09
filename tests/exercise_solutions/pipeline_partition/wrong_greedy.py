"""Greedy: fills each stage up to total / parts and starts the next before the layer that would pass
it (keeping enough layers for the stages left). A cut made early is never undone: not optimal."""


def balanced_split_points(sizes, parts):
    target, cut, acc = sum(sizes) / parts, [], 0
    for i, s in enumerate(sizes):
        must = len(sizes) - i == parts - 1 - len(cut)
        if len(cut) < parts - 1 and (must or (acc > 0 and acc + s > target)):
            cut.append(i)
            acc = 0
        acc += s
    return cut

EXPECT = ["the greedy cut", "fill each stage up to total / parts"]

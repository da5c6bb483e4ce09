"""Cuts every n / parts layers: equal numbers of layers, whatever they cost."""


def balanced_split_points(sizes, parts):
    n = len(sizes)
    return [k * n // parts for k in range(1, parts)]

EXPECT = ["equal numbers of layers, not equal cost"]

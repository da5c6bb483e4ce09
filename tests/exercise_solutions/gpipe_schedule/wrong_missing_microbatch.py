"""range(m - 1): the last micro-batch is never computed."""


def gpipe(p, m):
    return [[("F", i) for i in range(m - 1)] + [("B", i) for i in range(m - 1)] for _ in range(p)]


EXPECT = ["missing", "('B', 0)"]

"""One micro-batch at a time (F0 B0 F1 B1 ...): correct, but not pipelined: bubble (p-1)/p."""


def gpipe(p, m):
    return [[a for i in range(m) for a in (("F", i), ("B", i))] for _ in range(p)]


EXPECT = ["GPipe runs every forward before any backward"]

"""GPipe handed in as 1F1B: correct and deadlock-free, same bubble, but all m micro-batches in flight."""


def one_f_one_b(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


EXPECT = ["in flight", "1F1B keeps at most"]

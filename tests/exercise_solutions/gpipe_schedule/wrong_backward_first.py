"""The backwards first on the last stage, as if the flush came before the forwards."""


def gpipe(p, m):
    rows = [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
    rows[-1] = rows[-1][m:] + rows[-1][:m]
    return rows


EXPECT = ["comes before its forward"]

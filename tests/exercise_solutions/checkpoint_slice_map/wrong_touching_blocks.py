"""Treats blocks that only touch (one ends where the next begins) as overlapping: empty reads."""


def slice_map(pieces, offsets, sizes):
    reads = []
    for piece in pieces:
        src, dst = [], []
        for po, ps, o, s in zip(piece["offsets"], piece["sizes"], offsets, sizes):
            lo, hi = max(po, o), min(po + ps, o + s)
            if lo > hi:
                break
            src.append(slice(lo - po, hi - po))
            dst.append(slice(lo - o, hi - o))
        else:
            reads.append((piece["file"], piece["key"], tuple(src), tuple(dst)))
    return reads

EXPECT = ["is empty", "do not overlap"]

"""Counts src from the box's origin and dst from the piece's: the two origins swapped."""


def slice_map(pieces, offsets, sizes):
    reads = []
    for piece in pieces:
        src, dst = [], []
        for po, ps, o, s in zip(piece["offsets"], piece["sizes"], offsets, sizes):
            lo, hi = max(po, o), min(po + ps, o + s)
            if lo >= hi:
                break
            src.append(slice(lo - o, hi - o))
            dst.append(slice(lo - po, hi - po))
        else:
            reads.append((piece["file"], piece["key"], tuple(src), tuple(dst)))
    return reads

EXPECT = ['the dst of read', "count from the first element of this rank's array"]

"""Cuts src with the tensor's own indices instead of counting from the piece's first element."""


def slice_map(pieces, offsets, sizes):
    reads = []
    for piece in pieces:
        src, dst = [], []
        for po, ps, o, s in zip(piece["offsets"], piece["sizes"], offsets, sizes):
            lo, hi = max(po, o), min(po + ps, o + s)
            if lo >= hi:
                break
            src.append(slice(lo, hi))
            dst.append(slice(lo - o, hi - o))
        else:
            reads.append((piece["file"], piece["key"], tuple(src), tuple(dst)))
    return reads

EXPECT = ['outside 0:2', "count from the first element of the piece's array"]

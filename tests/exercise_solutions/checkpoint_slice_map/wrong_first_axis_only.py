"""Checks the overlap along the first axis only, and copies every other axis whole."""


def slice_map(pieces, offsets, sizes):
    reads = []
    for piece in pieces:
        po, ps, o, s = piece["offsets"][0], piece["sizes"][0], offsets[0], sizes[0]
        lo, hi = max(po, o), min(po + ps, o + s)
        if lo >= hi:
            continue
        rest = tuple(slice(0, n) for n in piece["sizes"][1:])
        reads.append((piece["file"], piece["key"], (slice(lo - po, hi - po),) + rest, (slice(lo - o, hi - o),) + rest))
    return reads

EXPECT = ['you put its element', 'The overlap of that piece']

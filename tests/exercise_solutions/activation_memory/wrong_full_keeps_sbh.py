"""Full recomputation keeps the layer's input, counted as sbh bytes: it is a 16-bit tensor of s·b·h
values, 2sbh bytes (2sbh/t with sequence parallelism)."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh = s * b * h
    d = t if sequence_parallel else 1
    if recompute == "full":
        return sbh / d
    replicated, split = 10 * sbh, 24 * sbh + (5 * a * s * s * b if recompute == "none" else 0)
    return (replicated + split) / t if sequence_parallel else replicated + split / t

EXPECT = ["recompute='full'", "= 1 sbh, expected", "2 bytes an element"]

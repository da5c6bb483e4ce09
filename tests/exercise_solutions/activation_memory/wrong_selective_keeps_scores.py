"""Treats selective recomputation as no recomputation: it redoes softmax, its dropout mask and the
dropout's output in backward, so their 5as²b is not kept."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))

EXPECT = ["recompute='selective'", "= 114 sbh, expected", "34sbh", "kept the s² pieces"]

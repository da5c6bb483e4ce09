"""Reads sequence_parallel but never uses it: tensor parallelism's formula for every layout, so the
10sbh that sequence parallelism splits along the sequence stay whole."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        return sbh * (10 + 24 / t)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))

EXPECT = ["t=2, sequence_parallel=True, recompute='none'", "sequence_parallel ignored", "sbh/t(34 + 5as/h)"]

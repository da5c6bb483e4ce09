"""Keeps the attention scores' 5as²b whole under tensor parallelism: each rank computes a/t of the
heads, so it holds a/t heads' scores, softmax outputs and masks: 5as²b/t."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    scores = 5 * a * s * s * b if recompute == "none" else 0
    if sequence_parallel:
        return 34 * sbh / t + scores
    return sbh * (10 + 24 / t) + scores

EXPECT = ["t=2, sequence_parallel=False, recompute='none'", "not divided by t", "5as²b/t"]

"""Counts every saved tensor at 2 bytes an element, the three dropout masks too: a mask is 1 byte
(Korthikanti et al. count as²b for the softmax's, sbh for each of the other two)."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh, scores = s * b * h, a * s * s * b
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    replicated = 2 * 2 * sbh + 2 * sbh + 2 * sbh + 2 * sbh + 2 * sbh      # LNs, two inputs, two masks at 2 bytes
    split = 24 * sbh + (2 + 2 + 2) * scores * (recompute == "none")       # the softmax's mask at 2 bytes too
    return (replicated + split) / t if sequence_parallel else replicated + split / t

EXPECT = ["t=1, sequence_parallel=False, recompute='none'", "= 132 sbh", "dropout masks counted as 2 bytes"]

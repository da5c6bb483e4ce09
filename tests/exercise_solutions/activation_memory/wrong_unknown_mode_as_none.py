"""Counts any recompute mode it does not know as "none" (as a dict's .get(mode, 0) would): a typo
such as "partial" then plans with no recomputation instead of being refused."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    replicated, split = 10 * sbh, 24 * sbh + (0 if recompute == "selective" else 5 * a * s * s * b)
    return (replicated + split) / t if sequence_parallel else replicated + split / t

EXPECT = ["recompute='partial'", "expected ValueError"]

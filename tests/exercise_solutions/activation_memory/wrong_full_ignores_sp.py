"""Full recomputation keeps the whole layer input on every rank even with sequence parallelism: each
rank holds only its s/t positions of it there, 2sbh/t."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    replicated, split = 10 * sbh, 24 * sbh + (5 * a * s * s * b if recompute == "none" else 0)
    return (replicated + split) / t if sequence_parallel else replicated + split / t

EXPECT = ["t=2, sequence_parallel=True, recompute='full'", "2sbh/t with sbh", "sequence_parallel ignored"]

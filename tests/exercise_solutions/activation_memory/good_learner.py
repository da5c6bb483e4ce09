"""A learner's count, piece by piece as Section 4.1 lists them: each piece's bytes and whether tensor
parallelism splits it; sequence parallelism splits the rest too, recomputation drops what it redoes."""

PIECES = [  # (piece, bytes in units of sbh or of as²b, "sbh" / "scores", split by TP, recomputed by selective)
    ("first LayerNorm's input", 2, "sbh", False, False),
    ("QKV linear's input", 2, "sbh", False, False),
    ("Q and K for QK^T", 4, "sbh", True, False),
    ("softmax's output", 2, "scores", True, True),
    ("softmax dropout's mask", 1, "scores", True, True),
    ("softmax dropout's output", 2, "scores", True, True),
    ("V", 2, "sbh", True, False),
    ("output projection's input", 2, "sbh", True, False),
    ("attention dropout's mask", 1, "sbh", False, False),
    ("second LayerNorm's input", 2, "sbh", False, False),
    ("first MLP linear's input", 2, "sbh", False, False),
    ("GeLU's input", 8, "sbh", True, False),
    ("second MLP linear's input", 8, "sbh", True, False),
    ("MLP dropout's mask", 1, "sbh", False, False),
]


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {recompute!r}")
    unit = {"sbh": s * b * h, "scores": a * s * s * b}
    if recompute == "full":
        return 2 * unit["sbh"] / (t if sequence_parallel else 1)
    total = 0
    for _, count, per, split, recomputed in PIECES:
        if recompute == "selective" and recomputed:
            continue
        total += count * unit[per] / (t if split or sequence_parallel else 1)
    return total

"""Divides the whole layer by t under tensor parallelism: without sequence parallelism the LayerNorms'
inputs, the attention's and the MLP's inputs and the two dropout masks after them (10sbh) are whole
on every rank; only what lies between f and g is split."""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    if recompute not in ("none", "selective", "full"):
        raise ValueError(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    per_layer = sbh * (34 + (5 * a * s / h if recompute == "none" else 0))
    return per_layer / t

EXPECT = ["t=2, sequence_parallel=False, recompute='none'", "everything divided by t", "sbh(10 + 24/t), not 34sbh/t"]

"""Takes batch row b's slot to be slot b: right while the sequences sit in slots in batch order."""
from minitrain.backend import array_module


def kv_append(k_store, v_store, rows, starts, k, v):
    xp = array_module(k_store)
    B, H, T, D = k.shape
    for b in range(B):
        k_store[b, :, starts[b]:starts[b] + T] = k[b]
        v_store[b, :, starts[b]:starts[b] + T] = v[b]
    L = max(starts) + T
    keys = xp.stack([k_store[b, :, :L] for b in range(B)])
    values = xp.stack([v_store[b, :, :L] for b in range(B)])
    mask = xp.zeros((B, 1, T, L), bool)
    for b in range(B):
        mask[b, 0] = xp.arange(L)[None, :] > (starts[b] + xp.arange(T))[:, None]
    return keys, values, mask

EXPECT = ['k_store[0, :, 0] (slot 0, position 0) is wrong', 'slot rows[b] (not slot b)']

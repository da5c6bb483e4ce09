"""Returns each slot whole (max_len positions): the mask hides the rest, but attention reads it all."""
from minitrain.backend import array_module


def kv_append(k_store, v_store, rows, starts, k, v):
    xp = array_module(k_store)
    B, H, T, D = k.shape
    for b in range(B):
        k_store[rows[b], :, starts[b]:starts[b] + T] = k[b]
        v_store[rows[b], :, starts[b]:starts[b] + T] = v[b]
    L = k_store.shape[2]
    keys = xp.stack([k_store[rows[b]] for b in range(B)])
    values = xp.stack([v_store[rows[b]] for b in range(B)])
    mask = xp.zeros((B, 1, T, L), bool)
    for b in range(B):
        mask[b, 0] = xp.arange(L)[None, :] > (starts[b] + xp.arange(T))[:, None]
    return keys, values, mask

EXPECT = ['keys has shape (1, 2, 12, 3), expected (1, 2, 5, 3)', "not the slot's max_len 12"]

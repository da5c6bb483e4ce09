"""Masks every row as if it held as many tokens as the longest: a shorter sequence sees its padding."""
from minitrain.backend import array_module


def kv_append(k_store, v_store, rows, starts, k, v):
    xp = array_module(k_store)
    B, H, T, D = k.shape
    for b in range(B):
        k_store[rows[b], :, starts[b]:starts[b] + T] = k[b]
        v_store[rows[b], :, starts[b]:starts[b] + T] = v[b]
    L = max(starts) + T
    keys = xp.stack([k_store[rows[b], :, :L] for b in range(B)])
    values = xp.stack([v_store[rows[b], :, :L] for b in range(B)])
    mask = xp.zeros((B, 1, T, L), bool)
    for b in range(B):
        mask[b, 0] = xp.arange(L)[None, :] > (max(starts) + xp.arange(T))[:, None]
    return keys, values, mask

EXPECT = ['mask[0, 0, 0, 2] shows key 2', 'True exactly where j > starts[b] + i']

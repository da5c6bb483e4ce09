"""Writes every forward's new tokens at positions 0 .. T-1, over the prompt's keys and values."""
from minitrain.backend import array_module


def kv_append(k_store, v_store, rows, starts, k, v):
    xp = array_module(k_store)
    B, H, T, D = k.shape
    for b in range(B):
        k_store[rows[b], :, :T] = k[b]
        v_store[rows[b], :, :T] = v[b]
    L = max(starts) + T
    keys = xp.stack([k_store[rows[b], :, :L] for b in range(B)])
    values = xp.stack([v_store[rows[b], :, :L] for b in range(B)])
    mask = xp.zeros((B, 1, T, L), bool)
    for b in range(B):
        mask[b, 0] = xp.arange(L)[None, :] > (starts[b] + xp.arange(T))[:, None]
    return keys, values, mask

EXPECT = ['k_store[1, :, 0] (slot 1, position 0) is wrong', '(not from 0)']

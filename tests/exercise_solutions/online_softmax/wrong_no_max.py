"""Exponentiates the raw scores (no running max): exact on small scores, inf / nan near 1000."""
import numpy as np


def online_softmax_step(m, l, o, s, v):
    e = np.exp(s)
    return np.zeros_like(m), l + e.sum(axis=-1, keepdims=True), o + e @ v

EXPECT = ["m_new", "the larger of m and the block's row max"]

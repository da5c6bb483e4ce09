"""Masked scores replaced by 0 to keep -inf out of the arithmetic: the masked keys get weight e^(0 - m)."""
import numpy as np


def online_softmax_step(m, l, o, s, v):
    s = np.where(np.isinf(s), 0.0, s)
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    c = np.exp(m - m_new)
    e = np.exp(s - m_new)
    return m_new, l * c + e.sum(axis=-1, keepdims=True), o * c + e @ v

EXPECT = ["masked scores (-inf)", "l_new", "needs no special case", "gives the masked key a weight"]

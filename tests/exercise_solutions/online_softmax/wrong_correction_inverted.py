"""The correction upside down: e^(m_new - m) grows the old sums instead of shrinking them."""
import numpy as np


def online_softmax_step(m, l, o, s, v):
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    c = np.exp(m_new - m)
    c = np.where(np.isfinite(c), c, 0.0)
    e = np.exp(s - m_new)
    return m_new, l * c + e.sum(axis=-1, keepdims=True), o * c + e @ v

EXPECT = ["l_new", "after 2 folds", "multiply it by e^(m - m_new)"]

"""Rescales o when the max rises, but not l: the old sum stays against the old max."""
import numpy as np


def online_softmax_step(m, l, o, s, v):
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    c = np.exp(m - m_new)
    e = np.exp(s - m_new)
    return m_new, l + e.sum(axis=-1, keepdims=True), o * c + e @ v

EXPECT = ["l_new", "after 2 folds", "multiply it by e^(m - m_new)"]

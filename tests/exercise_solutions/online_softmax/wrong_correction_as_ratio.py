"""The correction as a ratio of exponentials, e^m / e^m_new: right on small scores, inf / inf = nan near 1000."""
import numpy as np


def online_softmax_step(m, l, o, s, v):
    m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
    with np.errstate(over="ignore", invalid="ignore"):
        c = np.exp(m) / np.exp(m_new)
    e = np.exp(s - m_new)
    return m_new, l * c + e.sum(axis=-1, keepdims=True), o * c + e @ v

EXPECT = ["scores near +1000 and -1000", "inf or nan where the truth is finite", "a raw score was exponentiated"]

"""Ring self-attention equals full attention (output and gradients of Q, K, V) at p = 1..4,
causal and not, with the sequence split across the ranks."""
import math

import numpy as np
import pytest

import minitrain as mt
from minitrain.comm import ThreadWorld
from minitrain.nn import functional as F
from minitrain.parallel.context_parallel.ring import ring_attention


def full_attention(q, k, v, causal):
    T = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        att = att.masked_fill(np.triu(np.ones((T, T), dtype=bool), k=1), -math.inf)
    return F.softmax(att, axis=-1) @ v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_ring_attention_equals_full_attention(p, causal):
    mt.set_default_dtype(np.float64)
    rng = np.random.default_rng(p)
    B, H, T, D = 2, 3, 4 * p, 5
    q, k, v, do = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    tq, tk, tv = (mt.Tensor(a, requires_grad=True) for a in (q, k, v))
    out = full_attention(tq, tk, tv, causal)
    out.backward(do)
    n = T // p

    def fn(comm):
        s = slice(comm.rank * n, (comm.rank + 1) * n)
        lq, lk, lv = (mt.Tensor(np.ascontiguousarray(a[:, :, s]), requires_grad=True) for a in (q, k, v))
        y = ring_attention(lq, lk, lv, comm, causal=causal)
        y.backward(np.ascontiguousarray(do[:, :, s]))
        return y.data, lq.grad, lk.grad, lv.grad, comm.stats.bytes_sent
    for r, (y, gq, gk, gv, sent) in enumerate(ThreadWorld(p).run(fn)):
        s = slice(r * n, (r + 1) * n)
        np.testing.assert_allclose(y, out.data[:, :, s], rtol=1e-10, atol=1e-12)
        for got, want in ((gq, tq.grad), (gk, tk.grad), (gv, tv.grad)):
            np.testing.assert_allclose(got, want[:, :, s], rtol=1e-9, atol=1e-12)
        block = B * H * n * D * 8
        assert sent == (2 * (p - 1) + 4 * (p - 1) + 2) * block if p > 1 else sent == 0   # K, V; K, V, dK, dV; dK, dV home

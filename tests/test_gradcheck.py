"""Every operation's backward against central differences (float64), broadcasting included."""
import numpy as np
import pytest

import minitrain as mt
from minitrain.nn import functional as F
from minitrain.testing import gradcheck


def T(rng, *shape, positive=False):
    a = rng.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.5
    return mt.Tensor(a, requires_grad=True)


CASES = {
    "add": (lambda a, b: a + b, [(3, 4), (3, 4)]),
    "add_broadcast_row": (lambda a, b: a + b, [(3, 4), (4,)]),
    "add_broadcast_outer": (lambda a, b: a + b, [(3, 1), (1, 4)]),
    "add_scalar_and_radd": (lambda a: 2.0 + a + 1.5, [(2, 3)]),
    "sub_broadcast": (lambda a, b: a - b, [(2, 3, 4), (3, 1)]),
    "rsub": (lambda a: 1.0 - a, [(5,)]),
    "mul_broadcast": (lambda a, b: a * b, [(2, 3, 4), (1, 4)]),
    "mul_same_tensor": (lambda a: a * a, [(3, 3)]),
    "div_broadcast": (lambda a, b: a / b, [(3, 4), ("pos", 4)]),
    "rtruediv": (lambda a: 2.0 / a, [("pos", 3, 2)]),
    "neg": (lambda a: -a, [(4,)]),
    "pow_scalar": (lambda a: a ** 3, [(3, 2)]),
    "pow_tensor": (lambda a, b: a ** b, [("pos", 3), (3,)]),
    "matmul_2d": (lambda a, b: a @ b, [(3, 4), (4, 5)]),
    "matmul_batched_2d": (lambda a, b: a @ b, [(2, 3, 4), (4, 5)]),
    "matmul_broadcast_batch": (lambda a, b: a @ b, [(2, 1, 3, 4), (5, 4, 2)]),
    "matmul_vec_mat": (lambda a, b: a @ b, [(4,), (2, 4, 3)]),
    "matmul_mat_vec": (lambda a, b: a @ b, [(2, 3, 4), (4,)]),
    "matmul_dot": (lambda a, b: a @ b, [(4,), (4,)]),
    "sum_all": (lambda a: a.sum(), [(3, 4)]),
    "sum_axis": (lambda a: a.sum(axis=1), [(2, 3, 4)]),
    "sum_axes_keepdims": (lambda a: a.sum(axis=(0, 2), keepdims=True), [(2, 3, 4)]),
    "mean_axis": (lambda a: a.mean(axis=-1), [(2, 3, 4)]),
    "mean_all": (lambda a: a.mean(), [(2, 5)]),
    "max_axis": (lambda a: a.max(axis=1), [(3, 5)]),
    "max_keepdims": (lambda a: a.max(axis=0, keepdims=True), [(4, 3)]),
    "exp": (lambda a: a.exp(), [(3, 3)]),
    "log": (lambda a: a.log(), [("pos", 3, 3)]),
    "tanh": (lambda a: a.tanh(), [(3, 3)]),
    "sqrt": (lambda a: a.sqrt(), [("pos", 4)]),
    "relu": (lambda a: F.relu(a), [(4, 5)]),
    "gelu": (lambda a: F.gelu(a), [(4, 5)]),
    "softmax": (lambda a: F.softmax(a, axis=-1), [(3, 5)]),
    "softmax_axis0": (lambda a: F.softmax(a, axis=0), [(3, 5)]),
    "log_softmax": (lambda a: F.log_softmax(a, axis=-1), [(3, 5)]),
    "reshape": (lambda a: a.reshape(4, 3) * 1.0, [(2, 6)]),
    "transpose": (lambda a: a.transpose(0, 2), [(2, 3, 4)]),
    "permute": (lambda a: a.permute(2, 0, 1), [(2, 3, 4)]),
    "T": (lambda a: a.T, [(2, 3)]),
    "getitem_slice": (lambda a: a[1:, ::2], [(3, 5)]),
    "getitem_int": (lambda a: a[1], [(3, 5)]),
    "getitem_fancy_repeated": (lambda a: a[np.array([0, 2, 0, 0])], [(3, 2)]),
    "cat": (lambda a, b: mt.cat([a, b], axis=1), [(2, 3), (2, 2)]),
    "split": (lambda a: mt.split(a, 2, axis=1)[1] * 2.0, [(2, 5)]),
    "split_sections": (lambda a: a.split([1, 4], axis=1)[1], [(2, 5)]),
    "masked_fill": (lambda a: a.masked_fill(np.triu(np.ones((4, 4), bool), 1), 0.0), [(2, 4, 4)]),
    "layer_norm": (lambda a, w, b: F.layer_norm(a, (5,), w, b), [(3, 5), (5,), (5,)]),
    "layer_norm_no_affine": (lambda a: F.layer_norm(a, 5), [(2, 3, 5)]),
    "layer_norm_2d_shape": (lambda a, w, b: F.layer_norm(a, (3, 4), w, b), [(2, 3, 4), (3, 4), (3, 4)]),
    "linear_3d": (lambda x, w, b: F.linear(x, w, b), [(2, 3, 4), (5, 4), (5,)]),
    "linear_no_bias": (lambda x, w: F.linear(x, w), [(3, 4), (2, 4)]),
    "cross_entropy": (lambda a: F.cross_entropy(a, np.array([0, 2, 1, 2])), [(4, 3)]),
    "cross_entropy_3d": (lambda a: F.cross_entropy(a, np.array([[0, 1, 2], [2, 0, 1]])), [(2, 3, 3)]),   # (N, C, d)
    "mse": (lambda a, b: F.mse_loss(a, b), [(3, 2), (3, 2)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_matches_central_differences(name, float64, rng):
    fn, shapes = CASES[name]
    inputs = []
    for shape in shapes:
        positive = bool(shape) and shape[0] == "pos"
        inputs.append(T(rng, *(shape[1:] if positive else shape), positive=positive))
    gradcheck(fn, inputs)


def test_embedding_backward_adds_repeated_rows(float64, rng):
    w = T(rng, 5, 3)
    idx = np.array([[0, 3, 3], [4, 0, 3]])
    gradcheck(lambda w: F.embedding(idx, w), [w])


def test_dropout_backward_with_replayed_mask(float64, rng):
    x = T(rng, 4, 6)

    def fn(x):
        mt.manual_seed(7)   # the same mask on every evaluation
        return F.dropout(x, 0.3, training=True)
    gradcheck(fn, [x])


def test_small_gpt_loss_gradients(float64):
    mt.manual_seed(3)
    model = mt.nn.GPT(mt.nn.GPTConfig(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=4))
    idx = np.array([[1, 2, 3, 4], [0, 6, 5, 1]])
    params = list(model.parameters())

    def loss(*_):
        return model(idx, idx)[1]
    gradcheck(loss, params, atol=1e-6)

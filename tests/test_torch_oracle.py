"""minitrain against PyTorch (float64, 1e-10): every op, Linear, LayerNorm, attention, the GPT
block and the whole GPT, and 10 steps of SGD / Adam / AdamW. Skipped where torch is absent
(.ci/run installs the CPU wheel torch==2.13.0)."""
import math

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.nn import functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional
TOL = dict(rtol=1e-10, atol=1e-10)


def pair(a):
    """The same float64 data as a minitrain leaf and a torch leaf."""
    return mt.Tensor(a.copy(), requires_grad=True), torch.tensor(a.copy(), requires_grad=True)


def close(ours, theirs):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else theirs
    ours = ours.numpy() if isinstance(ours, mt.Tensor) else ours
    np.testing.assert_allclose(ours, theirs, **TOL)


OPS = {
    "add_broadcast": (lambda a, b: a + b, lambda a, b: a + b, [(3, 4), (4,)]),
    "sub": (lambda a, b: a - b, lambda a, b: a - b, [(2, 3), (2, 1)]),
    "mul": (lambda a, b: a * b, lambda a, b: a * b, [(2, 3, 4), (3, 4)]),
    "div": (lambda a, b: a / b, lambda a, b: a / b, [(3, 4), ("pos", 3, 4)]),
    "pow": (lambda a: a ** 3, lambda a: a ** 3, [(3, 4)]),
    "matmul_batched": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 4), (2, 4, 5)]),
    "matmul_broadcast": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 1, 3, 4), (5, 4, 2)]),
    "sum": (lambda a: a.sum(axis=1), lambda a: a.sum(dim=1), [(3, 4, 2)]),
    "mean": (lambda a: a.mean(axis=(0, 2), keepdims=True), lambda a: a.mean(dim=(0, 2), keepdim=True), [(3, 4, 2)]),
    "max": (lambda a: a.max(axis=-1), lambda a: a.amax(dim=-1), [(3, 6)]),
    "exp": (lambda a: a.exp(), lambda a: a.exp(), [(3, 4)]),
    "log": (lambda a: a.log(), lambda a: a.log(), [("pos", 3, 4)]),
    "tanh": (lambda a: a.tanh(), lambda a: a.tanh(), [(3, 4)]),
    "relu": (F.relu, TF.relu, [(5, 4)]),
    "gelu": (F.gelu, lambda a: TF.gelu(a, approximate="tanh"), [(5, 4)]),
    "softmax": (lambda a: F.softmax(a, -1), lambda a: TF.softmax(a, -1), [(3, 7)]),
    "log_softmax": (lambda a: F.log_softmax(a, 1), lambda a: TF.log_softmax(a, 1), [(3, 7)]),
    "transpose": (lambda a: a.transpose(1, 2), lambda a: a.transpose(1, 2), [(2, 3, 4)]),
    "permute": (lambda a: a.permute(2, 0, 1), lambda a: a.permute(2, 0, 1), [(2, 3, 4)]),
    "reshape": (lambda a: a.reshape(6, 4), lambda a: a.reshape(6, 4), [(2, 3, 4)]),
    "getitem": (lambda a: a[:, 1:3], lambda a: a[:, 1:3], [(3, 5)]),
    "cat": (lambda a, b: mt.cat([a, b], 0), lambda a, b: torch.cat([a, b], 0), [(2, 3), (4, 3)]),
    "split": (lambda a: a.split(2, axis=1)[2], lambda a: a.split(2, dim=1)[2], [(3, 5)]),
    "layer_norm": (lambda a, w, b: F.layer_norm(a, (6,), w, b),
                   lambda a, w, b: TF.layer_norm(a, (6,), w, b), [(2, 3, 6), (6,), (6,)]),
    "linear": (F.linear, TF.linear, [(2, 3, 4), (5, 4), (5,)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_forward_and_backward_match_torch(name, float64, rng):
    ours_fn, torch_fn, shapes = OPS[name]
    ours, theirs = [], []
    for shape in shapes:
        positive = shape[0] == "pos"
        a = rng.standard_normal(shape[1:] if positive else shape)
        a = np.abs(a) + 0.5 if positive else a
        m, t = pair(a)
        ours.append(m)
        theirs.append(t)
    out_m, out_t = ours_fn(*ours), torch_fn(*theirs)
    close(out_m, out_t)
    g = rng.standard_normal(out_t.shape)
    out_m.backward(g)
    out_t.backward(torch.tensor(g))
    for m, t in zip(ours, theirs):
        close(m.grad, t.grad)


@pytest.mark.parametrize("exponent", [0, 1, 2, "tensor"])
def test_pow_gradients_at_a_zero_base_match_torch(exponent, float64):
    """x**0 has gradient 0 everywhere and 0**b has exponent-gradient 0 for b >= 0 (PyTorch's rule); the plain
    formulas read 0 * inf and 0 * log(0): NaN."""
    base = np.array([0.0, 0.0, 1.5, 2.0])
    m, t = pair(base)
    if exponent == "tensor":
        em, et = pair(np.array([0.0, 2.0, 0.0, 0.5]))
        out_m, out_t = m ** em, t ** et
    else:
        em = et = None
        out_m, out_t = m ** exponent, t ** exponent
    close(out_m, out_t)
    out_m.sum().backward()
    out_t.sum().backward()
    close(m.grad, t.grad)
    if em is not None:
        close(em.grad, et.grad)


@pytest.mark.parametrize("name", ["mean_over_an_empty_axis", "masked_fill_with_a_wider_mask"])
def test_backward_edge_shapes_match_torch(name, float64, rng):
    """An empty batch's mean (its backward divided by a count of 0) and a mask with more dimensions than
    the tensor (its gradient had the broadcast shape, not the tensor's): both raised, torch computes them."""
    if name == "mean_over_an_empty_axis":
        m, t = pair(np.zeros((0, 3)))
        out_m, out_t = m.mean(axis=0), t.mean(dim=0)
    else:
        m, t = pair(rng.standard_normal(3))
        mask = np.array([[True, False, True], [False, False, True]])
        out_m, out_t = m.masked_fill(mask, 0.5), t.masked_fill(torch.tensor(mask), 0.5)
    close(out_m, out_t)
    g = rng.standard_normal(out_t.shape)
    out_m.backward(g)
    out_t.backward(torch.tensor(g))
    close(m.grad, t.grad)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_a_0_d_tensor_reduces_over_axis_0_or_minus_1_as_torch(op, float64):
    """Torch takes dim 0 or -1 of a 0-d tensor (nothing to reduce); the axis arithmetic divided by its 0
    dimensions. An axis out of range is refused by name, not wrapped."""
    for axis in (0, -1):
        m, t = pair(np.array(3.0))
        out_m, out_t = getattr(m, op)(axis=axis), (t.amax(dim=axis) if op == "max" else getattr(t, op)(dim=axis))
        assert out_m.shape == tuple(out_t.shape) == ()
        out_m.backward()
        out_t.backward()
        close(out_m, out_t)
        close(m.grad, t.grad)
    with pytest.raises(IndexError, match=r"axis 2 is out of range for a tensor of 2 dimension\(s\) \(expected in \[-2, 1\]\)"):
        getattr(mt.Tensor(np.ones((2, 3))), op)(axis=2)


@pytest.mark.parametrize("shape, target_shape", [((6, 5), (6,)), ((5,), ()), ((2, 5, 3), (2, 3)), ((2, 5, 5), (2, 5)),
                                                 ((2, 5, 3, 4), (2, 3, 4))])
def test_cross_entropy_matches_torch(float64, rng, shape, target_shape):
    """PyTorch's shapes: the classes on dim 1 ((N, C, C) included: read along the last dim, the same shapes
    would have been a wrong loss, not an error)."""
    m, t = pair(rng.standard_normal(shape))
    y = rng.integers(0, 5, target_shape)
    lm, lt = F.cross_entropy(m, y), TF.cross_entropy(t, torch.tensor(y))
    close(lm, lt)
    lm.backward()
    lt.backward()
    close(m.grad, t.grad)
    with pytest.raises(ValueError, match=r"needs targets of shape"):
        F.cross_entropy(m, np.zeros(shape, np.int64))


def copy_into_torch(ours, theirs):
    """Copy minitrain parameters into a torch module of the same names and layouts."""
    sd = {k: torch.tensor(np.array(v)) for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if not k.endswith("mask")], missing


def test_linear_layer_matches_torch(float64, rng):
    ours = nn.Linear(4, 3)
    theirs = torch.nn.Linear(4, 3).double()
    copy_into_torch(ours, theirs)
    x = rng.standard_normal((5, 4))
    out_m, out_t = ours(mt.Tensor(x)), theirs(torch.tensor(x))
    close(out_m, out_t)
    out_m.sum().backward()
    out_t.sum().backward()
    close(ours.weight.grad, theirs.weight.grad)
    close(ours.bias.grad, theirs.bias.grad)


def test_layernorm_module_matches_torch(float64, rng):
    ours = nn.LayerNorm(6)
    ours.weight.data[...] = rng.standard_normal(6)
    ours.bias.data[...] = rng.standard_normal(6)
    theirs = torch.nn.LayerNorm(6).double()
    copy_into_torch(ours, theirs)
    x_m, x_t = pair(rng.standard_normal((2, 3, 6)))
    out_m, out_t = ours(x_m), theirs(x_t)
    close(out_m, out_t)
    g = rng.standard_normal((2, 3, 6))
    out_m.backward(g)
    out_t.backward(torch.tensor(g))
    close(x_m.grad, x_t.grad)
    close(ours.weight.grad, theirs.weight.grad)
    close(ours.bias.grad, theirs.bias.grad)


# ---- a reference GPT in PyTorch with nanoGPT's module names (so state dicts copy by name)
class TorchAttention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = torch.nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = torch.nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class TorchBlock(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(c.n_embd)
        self.attn = TorchAttention(c)
        self.ln_2 = torch.nn.LayerNorm(c.n_embd)
        self.mlp = torch.nn.Module()
        self.mlp.c_fc = torch.nn.Linear(c.n_embd, 4 * c.n_embd)
        self.mlp.c_proj = torch.nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(TF.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = torch.nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = torch.nn.Embedding(c.block_size, c.n_embd)
        self.h = torch.nn.ModuleList([TorchBlock(c) for _ in range(c.n_layer)])
        self.ln_f = torch.nn.LayerNorm(c.n_embd)
        self.lm_head = torch.nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


CONFIG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)


def randomize(module, rng):
    """Random non-trivial values everywhere (LayerNorm weights and biases included)."""
    for p in module.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5


def test_attention_matches_torch(float64, rng):
    c = nn.GPTConfig(**CONFIG)
    ours, theirs = nn.CausalSelfAttention(c), TorchAttention(c).double()
    randomize(ours, rng)
    copy_into_torch(ours, theirs)
    x_m, x_t = pair(rng.standard_normal((2, 6, 8)))
    out_m, out_t = ours(x_m), theirs(x_t)
    close(out_m, out_t)
    g = rng.standard_normal(out_t.shape)
    out_m.backward(g)
    out_t.backward(torch.tensor(g))
    close(x_m.grad, x_t.grad)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, theirs_params[name].grad)


def test_gpt_block_matches_torch(float64, rng):
    c = nn.GPTConfig(**CONFIG)
    ours, theirs = nn.Block(c), TorchBlock(c).double()
    randomize(ours, rng)
    copy_into_torch(ours, theirs)
    x_m, x_t = pair(rng.standard_normal((3, 5, 8)))
    out_m, out_t = ours(x_m), theirs(x_t)
    close(out_m, out_t)
    g = rng.standard_normal(out_t.shape)
    out_m.backward(g)
    out_t.backward(torch.tensor(g))
    close(x_m.grad, x_t.grad)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, theirs_params[name].grad)


def test_whole_gpt_loss_and_gradients_match_torch(float64, rng):
    c = nn.GPTConfig(**CONFIG)
    ours, theirs = nn.GPT(c), TorchGPT(c).double()
    randomize(ours, rng)
    copy_into_torch(ours, theirs)
    idx = rng.integers(0, c.vocab_size, (3, c.block_size))
    targets = rng.integers(0, c.vocab_size, (3, c.block_size))
    _, loss_m = ours(idx, targets)
    logits_t = theirs(torch.tensor(idx))
    loss_t = TF.cross_entropy(logits_t.reshape(-1, c.vocab_size), torch.tensor(targets).reshape(-1))
    close(loss_m, loss_t)
    loss_m.backward()
    loss_t.backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, theirs_params[name].grad)


OPTIMIZERS = {
    "sgd": (lambda ps: optim.SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_momentum_wd": (lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
                        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2)),
    "sgd_nesterov": (lambda ps: optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    "adam": (lambda ps: optim.Adam(ps, lr=1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    "adam_wd": (lambda ps: optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "adamw": (lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ten_optimizer_steps_match_torch(name, float64, rng):
    make_ours, make_theirs = OPTIMIZERS[name]
    ours = nn.MLP([6, 16, 16, 4])
    theirs = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                 torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    copy_into_torch(ours, theirs)
    opt_m, opt_t = make_ours(list(ours.parameters())), make_theirs(theirs.parameters())
    for step in range(10):
        x = rng.standard_normal((8, 6))
        y = rng.integers(0, 4, 8)
        loss_m = F.cross_entropy(ours(mt.Tensor(x)), y)
        loss_t = TF.cross_entropy(theirs(torch.tensor(x)), torch.tensor(y))
        close(loss_m, loss_t)
        opt_m.zero_grad()
        opt_t.zero_grad()
        loss_m.backward()
        loss_t.backward()
        opt_m.step()
        opt_t.step()
    theirs_params = dict(theirs.named_parameters())
    for pname, p in ours.named_parameters():
        close(p.data, theirs_params[pname])


def test_clip_grad_norm_matches_torch(float64, rng):
    ours = nn.MLP([5, 7, 3])
    theirs = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)).double()
    copy_into_torch(ours, theirs)
    x = rng.standard_normal((4, 5)) * 10
    ours(mt.Tensor(x)).sum().backward()
    theirs(torch.tensor(x)).sum().backward()
    norm_m = optim.clip_grad_norm_(ours.parameters(), 0.5)
    norm_t = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    assert math.isclose(norm_m, float(norm_t), rel_tol=1e-12)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, theirs_params[name].grad)


def test_masked_attention_with_a_row_masked_whole_matches_scaled_dot_product_attention(float64, rng):
    """A query row that may attend to nothing gets weights 0 and gradient 0, as in PyTorch's SDPA,
    where softmax(where(mask, -inf, s)) alone would give NaN and spread it through backward."""
    q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
    mask = np.array([[False, True, True], [True, True, True], [False, False, True]])     # True: masked out
    (qm, qt), (km, kt), (vm, vt) = pair(q), pair(k), pair(v)
    out_m = F.softmax(qm @ km.transpose(1, 2), axis=-1, scale=0.5, mask=mask) @ vm
    out_t = TF.scaled_dot_product_attention(qt, kt, vt, attn_mask=torch.tensor(~mask), scale=0.5)
    g = rng.standard_normal(out_m.shape)
    (out_m * mt.Tensor(g)).sum().backward()
    (out_t * torch.tensor(g)).sum().backward()
    close(out_m, out_t)
    for ours, theirs in ((qm, qt), (km, kt), (vm, vt)):
        close(ours.grad, theirs.grad)
    assert not np.any(out_m.data[:, 1]) and not np.any(qm.grad[:, 1])

"""Module, Parameter and layers: registration, names, state dicts, hooks, modes, init."""
import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.nn import functional as F


def test_named_parameters_in_registration_order_with_dotted_names():
    model = nn.MLP([3, 4, 2])
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert model[0].weight.shape == (4, 3)      # torch.nn.Linear layout: (out, in)


def test_tied_parameter_listed_once():
    model = nn.GPT(nn.GPTConfig(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4, tie_weights=True))
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert model.lm_head.weight is model.wte.weight


def test_gpt_parameter_count_matches_the_formula():
    c = nn.GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=8)
    model = nn.GPT(c)
    per_layer = 12 * c.n_embd ** 2 + 13 * c.n_embd
    expected = (c.n_layer * per_layer + c.vocab_size * c.n_embd + c.block_size * c.n_embd
                + 2 * c.n_embd + c.vocab_size * c.n_embd)
    assert model.num_parameters() == expected


def test_state_dict_round_trip_and_errors():
    a, b = nn.MLP([3, 5, 2]), nn.MLP([3, 5, 2])
    b.load_state_dict(a.state_dict())
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
        assert p.data is not q.data
    with pytest.raises(ValueError, match="shape"):
        nn.MLP([3, 6, 2]).load_state_dict(a.state_dict())
    with pytest.raises(KeyError, match="missing"):
        nn.MLP([3, 5, 5, 2]).load_state_dict(a.state_dict())


def test_forward_hooks_run_around_forward():
    layer = nn.Linear(2, 2)
    events = []
    layer.register_forward_pre_hook(lambda m, args: events.append("pre"))
    h = layer.register_forward_hook(lambda m, args, out: events.append("post") or out * 0.0)
    out = layer(mt.Tensor(np.ones((1, 2), dtype=np.float32)))
    assert events == ["pre", "post"] and float(out.sum().item()) == 0.0
    h.remove()
    layer(mt.Tensor(np.ones((1, 2), dtype=np.float32)))
    assert events == ["pre", "post", "pre"]


def test_eval_turns_dropout_off_and_train_back_on():
    model = nn.Sequential(nn.Dropout(0.5))
    x = mt.Tensor(np.ones((100,), dtype=np.float32))
    assert (model(x).numpy() == 0).any()
    model.eval()
    np.testing.assert_array_equal(model(x).numpy(), x.numpy())
    model.train()
    assert model[0].training


def test_dropout_replays_with_the_rng_state():
    x = mt.Tensor(np.ones((50,), dtype=np.float32))
    state = mt.random.get_state()
    first = nn.functional.dropout(x, 0.5).numpy()
    mt.random.set_state(state)
    np.testing.assert_array_equal(nn.functional.dropout(x, 0.5).numpy(), first)
    kept = first[first != 0]
    np.testing.assert_allclose(kept, 2.0)


def test_manual_seed_makes_initialisation_reproducible():
    mt.manual_seed(5)
    a = nn.MLP([4, 4])
    mt.manual_seed(5)
    b = nn.MLP([4, 4])
    np.testing.assert_array_equal(a[0].weight.data, b[0].weight.data)


def test_linear_init_bound_is_torchs():
    layer = nn.Linear(100, 50)
    assert np.abs(layer.weight.data).max() <= 0.1 + 1e-7


def test_gpt_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        nn.GPTConfig(vocab_size=10, block_size=4, n_head=3, n_embd=8)
    model = nn.GPT(nn.GPTConfig(vocab_size=10, block_size=4, n_layer=1, n_head=2, n_embd=4))
    with pytest.raises(ValueError, match="block_size"):
        model(np.zeros((1, 5), dtype=np.int64))


def test_cross_entropy_rejects_bad_targets():
    logits = mt.Tensor(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(TypeError):
        nn.functional.cross_entropy(logits, np.array([0.0, 1.0]))
    with pytest.raises(IndexError):
        nn.functional.cross_entropy(logits, np.array([0, 3]))
    with pytest.raises(ValueError):
        nn.functional.cross_entropy(logits, np.array([0, 1, 2]))


def test_module_without_super_init_gets_a_clear_error():
    class Bad(nn.Module):
        def __init__(self):
            self.layer = nn.Linear(2, 2)
    with pytest.raises(AttributeError, match="super"):
        Bad()


@pytest.mark.parametrize("shapes", [((3, 1), (3,)), ((3,), (3, 1)), ((2, 3), (3,)), ((4,), (1,))])
def test_mse_loss_refuses_shapes_that_would_broadcast(shapes):
    # PyTorch warns and broadcasts (3, 1) against (3,) to (3, 3): the mean of the wrong pairs
    a, b = mt.Tensor(np.ones(shapes[0])), mt.Tensor(np.zeros(shapes[1]))
    with pytest.raises(ValueError, match=r"mse_loss: input of shape .* and target of shape .* differ"):
        F.mse_loss(a, b)
    assert F.mse_loss(mt.Tensor(np.full((3, 1), 2.0)), mt.Tensor(np.zeros((3, 1)))).item() == 4.0


def test_cross_entropy_refuses_targets_of_another_shape():
    with pytest.raises(ValueError, match=r"needs targets of shape \(4,\), got \(4, 1\)"):
        F.cross_entropy(mt.Tensor(np.zeros((4, 3))), np.zeros((4, 1), np.int64))


def test_the_vocab_parallel_loss_refuses_targets_of_another_shape():
    from minitrain.comm import ThreadWorld
    from minitrain.parallel.tensor_parallel import tensor_parallelize

    def fn(comm):
        mt.manual_seed(0)
        model = tensor_parallelize(nn.GPT(nn.GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8)), comm)
        logits = model(np.zeros((2, 4), np.int64))
        with pytest.raises(ValueError, match=r"need integer targets of shape \(2, 4\), got int64 \(8,\)"):
            model.loss(logits, np.zeros(8, np.int64))
    ThreadWorld(2).run(fn)


@pytest.mark.parametrize("index", [-1, 5, 7])
def test_an_embedding_index_outside_the_table_is_an_index_error_not_another_row(index):
    """As torch.nn.Embedding: NumPy's indexing would read -1 as the last row and say nothing."""
    table = nn.Embedding(5, 3)
    with pytest.raises(IndexError, match=rf"embedding: indices must lie in \[0, 5\), found {min(index, 0)}\.\.{max(index, 2)}"):
        table(np.array([[0, 2], [index, 1]]) if index > 0 else np.array([[index, 2], [0, 1]]))
    np.testing.assert_array_equal(table(np.array([4, 0])).data, table.weight.data[[4, 0]])


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_layer_norm_refuses_an_affine_parameter_of_another_shape(which):
    """A (1,) weight would broadcast over the normalized axis and train one scale for all; PyTorch refuses it."""
    x = mt.Tensor(np.ones((2, 4)))
    kwargs = {"weight": mt.Tensor(np.ones(4)), "bias": mt.Tensor(np.zeros(4))}
    kwargs[which] = mt.Tensor(np.ones(1))
    with pytest.raises(ValueError, match=f"layer_norm: {which} of shape \\(1,\\), expected normalized_shape \\(4,\\)"):
        F.layer_norm(x, 4, **kwargs)

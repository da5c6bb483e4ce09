"""Datasets and DistributedSampler: N ranks see exactly what one process sees."""
import numpy as np
import pytest

from minitrain.data import DataLoader, DistributedSampler, load_digits, load_text, make_classification


def test_digits_split_is_fixed_by_seed():
    a = load_digits(seed=0)
    b = load_digits(seed=0)
    x_train, y_train, x_test, y_test = a
    assert x_train.shape == (1438, 64) and x_test.shape == (359, 64)
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0
    assert set(np.unique(y_train)) == set(range(10))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(load_digits(seed=1)[1], y_train)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_batches_union_to_the_single_process_batch(world):
    n, per_rank = 96, 4
    single = DataLoader((np.arange(n),), per_rank * world, seed=3)
    ranks = [DataLoader((np.arange(n),), per_rank, sampler=DistributedSampler(n, num_replicas=world, rank=r, seed=3))
             for r in range(world)]
    for epoch in range(2):
        single.set_epoch(epoch)
        for loader in ranks:
            loader.set_epoch(epoch)
        for j, (global_batch,) in enumerate(single):
            union = np.concatenate([list(loader)[j][0] for loader in ranks])
            assert sorted(union.tolist()) == sorted(global_batch.tolist())


def test_sampler_shards_are_disjoint_and_padded():
    n, world = 10, 4
    shards = [DistributedSampler(n, num_replicas=world, rank=r, seed=0).indices() for r in range(world)]
    assert all(len(s) == 3 for s in shards)
    flat = np.concatenate(shards)
    assert set(flat.tolist()) == set(range(n))          # everything covered, 2 repeated as padding
    cut = [DistributedSampler(n, num_replicas=world, rank=r, seed=0, drop_last=True).indices() for r in range(world)]
    assert len(set(np.concatenate(cut).tolist())) == 8


def test_sampler_changes_order_with_the_epoch():
    s = DistributedSampler(50, num_replicas=1, rank=0, seed=0)
    first = s.indices().copy()
    s.set_epoch(1)
    assert not np.array_equal(first, s.indices())


def test_sampler_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 4"):
        DistributedSampler(10, num_replicas=4, rank=4)


def test_text_corpus_round_trips_and_batches():
    corpus = load_text(max_chars=5000)
    assert corpus.decode(corpus.encode("def f(x):")) == "def f(x):"
    x, y = corpus.get_batch("train", 3, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (3, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_synthetic_data_is_reproducible():
    a, b = make_classification(100, 8, 3, seed=1), make_classification(100, 8, 3, seed=1)
    np.testing.assert_array_equal(a[0], b[0])
    assert set(np.unique(a[1])) <= {0, 1, 2}


def test_loader_drop_last():
    loader = DataLoader((np.arange(10),), 4, shuffle=False, drop_last=True)
    assert [len(b[0]) for b in loader] == [4, 4] and len(loader) == 2


def test_digits_are_scikit_learns_exactly_and_load_without_importing_it():
    import subprocess
    import sys
    code = ("import sys, numpy as np; from minitrain.data import load_digits; a = load_digits(dtype=np.float64); "
            "print('sklearn' in sys.modules, 'scipy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["False", "False"]
    sk = pytest.importorskip("sklearn.datasets").load_digits()
    x_train, y_train, x_test, y_test = load_digits(dtype=np.float64)
    order = np.random.default_rng(0).permutation(len(sk.target))
    assert np.array_equal(np.concatenate([x_test, x_train]), sk.data[order] / 16.0)
    assert np.array_equal(np.concatenate([y_test, y_train]), sk.target[order]) and y_train.dtype == np.int64


def test_the_sampler_takes_pytorchs_call_shape():
    """DistributedSampler(dataset, num_replicas, rank, ...), as torch.utils.data.distributed's: it was (n, rank,
    world), so PyTorch's positional DistributedSampler(data, 2, 1) was read as rank 2 of a world of 1."""
    data = np.arange(10)
    assert DistributedSampler(data, 2, 1, shuffle=False).indices().tolist() == [1, 3, 5, 7, 9]
    assert DistributedSampler(10, num_replicas=2, rank=1, shuffle=False).num_replicas == 2
    with pytest.raises(ValueError, match=r"give num_replicas and rank \(e.g. dist.get_world_size\(\)"):
        DistributedSampler(data)                # (data/ does not read the process group: docs/architecture.md)

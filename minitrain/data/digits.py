"""The real 8x8 handwritten digits (UCI, 1797 images, 10 classes) that ship inside scikit-learn.

Pixels are scaled to [0, 1]; the train/test split is a seeded permutation (default 80/20),
so every rank and every run sees the same split.
"""
import numpy as np

from .. import backend


def load_digits(test_fraction=0.2, seed=0, dtype=None):
    """Returns (x_train, y_train, x_test, y_test): float features (n, 64), int64 labels."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise ImportError("the digits data ships with scikit-learn: pip install -e '.[dev]'") from e
    data = sk_load_digits()
    x = (data.data / 16.0).astype(dtype or backend.get_default_dtype())
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]

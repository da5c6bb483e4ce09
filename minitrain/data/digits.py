"""The real 8x8 handwritten digits (UCI, 1797 images, 10 classes) that ship inside scikit-learn.

Pixels are scaled to [0, 1]; the train/test split is a seeded permutation (default 80/20),
so every rank and every run sees the same split.
"""
import gzip
import importlib.util
import pathlib

import numpy as np

from .. import backend


def _digits_csv():
    """scikit-learn's copy of the data, found without importing scikit-learn (which costs each rank a
    second of start-up and loads SciPy's BLAS beside NumPy's)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits data ships with scikit-learn: pip install -e '.[dev]'")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():
        raise ImportError(f"scikit-learn is installed but its digits data is missing ({path})")
    return path


SAMPLES = 1797                          # the 8x8 digits: 1,797 images


def _test_rows(n, test_fraction):
    return int(round(n * test_fraction))


def train_rows(test_fraction=0.2):
    """The training split's size (load_digits' x_train rows), without reading the data."""
    return SAMPLES - _test_rows(SAMPLES, test_fraction)


def load_digits(test_fraction=0.2, seed=0, dtype=None):
    """Returns (x_train, y_train, x_test, y_test): float features (n, 64), int64 labels."""
    with gzip.open(_digits_csv(), "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    x = (table[:, :-1] / 16.0).astype(dtype or backend.get_default_dtype())
    y = table[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = _test_rows(len(x), test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]

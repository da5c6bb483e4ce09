"""Synthetic data of any size, for benchmarks: Gaussian inputs labelled by a fixed random
linear teacher (so a model can learn it), reproducible from the seed."""
import numpy as np

from .. import backend


def make_classification(n, features, classes, seed=0, dtype=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(dtype or backend.get_default_dtype())
    teacher = rng.standard_normal((features, classes))
    y = (x @ teacher).argmax(axis=1).astype(np.int64)
    return x, y

import numpy as np
import pytest

import minitrain


@pytest.fixture
def float64():
    """Run the test with float64 as the default dtype (oracle tests compare at 1e-10)."""
    old = minitrain.get_default_dtype()
    minitrain.set_default_dtype(np.float64)
    minitrain.manual_seed(0)
    yield
    minitrain.set_default_dtype(old)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    """A test that sets the default dtype (many switch to float64 inside ThreadWorld workers) must
    not change it for the tests after it."""
    old = minitrain.get_default_dtype()
    yield
    minitrain.set_default_dtype(old)

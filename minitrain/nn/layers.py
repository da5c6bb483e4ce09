"""Layers with PyTorch's parameter layouts and default initialisations, so weights copy one-to-one
between minitrain and torch (Linear.weight is (out_features, in_features))."""
import math

from .. import backend, random
from . import functional as F
from .module import Module, Parameter


def _uniform(bound, shape):
    return random.uniform(-bound, bound, shape)


class Linear(Module):
    """y = x W^T + b. Init as torch: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        if not (in_features >= 0 and out_features >= 0):
            raise ValueError(f"Linear: in_features and out_features must be >= 0, got {in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_uniform(bound, (out_features, in_features)))
        self.bias = Parameter(_uniform(bound, (out_features,))) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table of ``num_embeddings`` rows of size ``embedding_dim``; init N(0, 1) as torch."""

    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(random.randn(num_embeddings, embedding_dim))

    def forward(self, indices):
        return F.embedding(indices, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        xp, dtype = backend.xp(), backend.get_default_dtype()
        self.weight = Parameter(xp.ones(self.normalized_shape, dtype=dtype)) if elementwise_affine else None
        self.bias = Parameter(xp.zeros(self.normalized_shape, dtype=dtype)) if elementwise_affine and bias else None

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class GELU(Module):
    """GELU, tanh approximation (torch.nn.GELU(approximate='tanh'))."""

    def forward(self, x):
        return F.gelu(x)


class Dropout(Module):
    """Inverted dropout drawing its masks from ``minitrain.random`` (seeded, replayable)."""

    def __init__(self, p=0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}"


class Sequential(Module):
    """Modules applied in order; indexable and sliceable (a pipeline cuts one into stages)."""

    def __init__(self, *modules):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return Sequential(*mods[idx])
        return mods[idx]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleList(Module):
    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module):
        setattr(self, str(len(self._modules)), module)
        return self

    def __getitem__(self, idx):
        return list(self._modules.values())[idx]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class MLP(Sequential):
    """Linear layers of the given sizes with an activation between them:
    ``MLP([64, 128, 128, 10])`` is Linear(64,128), ReLU, Linear(128,128), ReLU, Linear(128,10).
    A Sequential, so a pipeline can cut it into stages."""

    def __init__(self, sizes, activation="relu", bias=True):
        if len(sizes) < 2:
            raise ValueError("MLP needs at least an input and an output size")
        acts = {"relu": ReLU, "gelu": GELU}
        if activation not in acts:
            raise ValueError(f"unknown activation {activation!r}: expected one of {sorted(acts)}")
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(Linear(a, b, bias=bias))
            if i < len(sizes) - 2:
                layers.append(acts[activation]())
        super().__init__(*layers)
        self.sizes = list(sizes)

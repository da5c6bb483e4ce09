"""Stateless layer functions (torch.nn.functional's names), each one fused graph node.
Integer and boolean inputs (targets, indices, masks) on the host meet device weights by a counted copy
to the device (the API edge); such inputs on the device with host weights are refused."""
from .. import backend
from ..autograd import Tensor, ops


def _raw(x):
    return x._data if isinstance(x, Tensor) else x


def linear(x, weight, bias=None):
    """x @ weight.T + bias, weight of shape (out_features, in_features)."""
    return ops.Linear.apply(x, weight, bias)


def relu(x):
    return ops.ReLU.apply(x)


def gelu(x):
    """GELU, tanh approximation (GPT-2's)."""
    return ops.GELU.apply(x)


def softmax(x, axis=-1, scale=None, mask=None):
    """softmax(x) along ``axis``; with ``scale`` and a boolean ``mask`` (True: masked out),
    softmax(where(mask, -inf, x·scale)) as one op (attention's scores)."""
    mask = mask.data if hasattr(mask, "requires_grad") else mask
    if mask is not None:
        mask = _inputs_beside(mask, _raw(x), "mask", "softmax")
    return ops.Softmax.apply(x, axis=axis, scale=scale, mask=mask)


def log_softmax(x, axis=-1):
    return ops.LogSoftmax.apply(x, axis=axis)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if tuple(x.shape[-len(normalized_shape):]) != normalized_shape:
        raise ValueError(f"layer_norm: input of shape {tuple(x.shape)} does not end in {normalized_shape}")
    for name, p in (("weight", weight), ("bias", bias)):     # NumPy would broadcast a (1,) weight silently
        if p is not None and tuple(p.shape) != normalized_shape:
            raise ValueError(f"layer_norm: {name} of shape {tuple(p.shape)}, expected normalized_shape {normalized_shape}")
    return ops.LayerNorm.apply(x, weight, bias, ndims=len(normalized_shape), eps=eps)


def _inputs_beside(values, like, what, call):
    """Host integers or booleans beside device data: moved on purpose; the reverse is refused."""
    if backend.is_device_array(like) and not backend.is_device_array(values):
        return backend.to_device(values)
    if backend.is_device_array(values) and not backend.is_device_array(like):
        verb = "are" if what.endswith("s") else "is"
        raise TypeError(f"{call}: {what} {verb} on the GPU but the weights on the host: pass "
                        f"minitrain.backend.to_host({what}) or move the model to the GPU")
    return values


def cross_entropy(input, target, validate_targets=False):
    """Mean cross-entropy of integer class targets, in PyTorch's shapes: input (C), (N, C) or (N, C, d1, ...,
    dk), the classes on dim 1, with target (), (N) or (N, d1, ..., dk) (no ignore_index, no label smoothing).
    A GPT's (B, T, V) logits are flattened to (B·T, V) first, as nanoGPT does.
    A target outside [0, C) is an IndexError on the CPU, where checking is free (always done). On
    the GPU checking means reading the targets' range back, a synchronisation in every step: by
    default an out-of-range target makes the loss NaN instead (no wait; PyTorch's CUDA kernel trips a
    device-side assert, reported at a later synchronisation); validate_targets=True checks them
    (one synchronisation, IndexError)."""
    targets, shape = _raw(target), tuple(input.shape)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integer class indices, got {targets.dtype}")
    classes_dim = 1 if len(shape) > 1 else 0
    expected = shape[:classes_dim] + shape[classes_dim + 1:]
    if tuple(targets.shape) != expected:
        raise ValueError(f"cross_entropy: input {shape} (classes on dim {classes_dim}) needs targets "
                         f"of shape {expected}, got {tuple(targets.shape)}")
    if len(shape) > 2:                       # the classes to the last axis, where CrossEntropy reads them
        input = input.permute(0, *range(2, len(shape)), 1)
    if backend.is_device_array(_raw(input)) and not backend.is_device_array(targets):
        ops.check_targets(targets.reshape(-1), shape[classes_dim])      # free here, while on the host
    targets = _inputs_beside(targets, _raw(input), "targets", "cross_entropy")
    return ops.CrossEntropy.apply(input, targets, validate_targets=validate_targets)


def mse_loss(input, target):
    """Mean squared error of two tensors of the same shape. PyTorch only warns when the shapes
    differ and then broadcasts ((3, 1) against (3,) becomes (3, 3)): a silent wrong loss; refused."""
    shape_in, shape_t = tuple(input.shape), tuple(getattr(target, "shape", ()))
    if shape_in != shape_t:
        raise ValueError(f"mse_loss: input of shape {shape_in} and target of shape {shape_t} differ; they would "
                         f"broadcast to another shape and average the wrong pairs (reshape one of them)")
    diff = input - target
    return (diff * diff).mean()


def embedding(indices, weight):
    """weight[indices]. An index outside [0, num_embeddings) is an IndexError where checking is free (indices on
    the host), as torch.nn.Embedding's: NumPy would read -1 as the last row. Indices already on the GPU are not
    read back (a synchronisation a step), as cross_entropy's targets."""
    indices = _raw(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers, got {indices.dtype}")
    if not backend.is_device_array(indices):
        ops.check_targets(indices.reshape(-1), _raw(weight).shape[0], "embedding", "indices")
    indices = _inputs_beside(indices, _raw(weight), "indices", "embedding")
    return ops.Embedding.apply(indices, weight)


def dropout(x, p=0.5, training=True):
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    return ops.Dropout.apply(x, p)

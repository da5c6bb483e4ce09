"""The differentiable operations, each forward next to its backward, one family per module:

    arithmetic.py    +, -, *, /, **, exp, log, tanh, a dtype cast; unbroadcast
    matmul.py        MatMul, Linear (and matmul_rows, the product both use on the GPU)
    reductions.py    Sum, Mean, Max
    shape.py         Reshape, Permute, GetItem, Cat, MaskedFill, Embedding
    activations.py   ReLU, GELU, Dropout
    softmax.py       Softmax, LogSoftmax, CrossEntropy
    layer_norm.py    LayerNorm (Ba et al. 2016)

Forwards receive and return raw xp arrays; backwards return one gradient per positional
input (None where no gradient is needed). Broadcasting is undone by the one helper
unbroadcast. Dtypes never widen: constants are Python floats, which NumPy 2 treats as
"weak" (a float32 array times 0.5 stays float32), never NumPy float64 scalars.
"""
from .arithmetic import unbroadcast, Add, Sub, Mul, Div, Neg, Pow, Cast, Exp, Log, Tanh
from .matmul import MatMul, matmul_rows, Linear
from .reductions import Sum, Mean, Max
from .shape import Reshape, Permute, GetItem, Cat, MaskedFill, Embedding
from .activations import ReLU, GELU, Dropout
from .softmax import Softmax, LogSoftmax, check_targets, CrossEntropy
from .layer_norm import LayerNorm

__all__ = ["unbroadcast", "Add", "Sub", "Mul", "Div", "Neg", "Pow", "Cast", "Exp", "Log", "Tanh",
           "MatMul", "matmul_rows", "Linear", "Sum", "Mean", "Max",
           "Reshape", "Permute", "GetItem", "Cat", "MaskedFill", "Embedding",
           "ReLU", "GELU", "Dropout", "Softmax", "LogSoftmax", "check_targets", "CrossEntropy", "LayerNorm"]

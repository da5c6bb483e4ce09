"""The matrix product, and Linear (y = x W^T + b) as one graph node; their backwards are products too:
dA = dC B^T and dB = A^T dC, with batch dimensions folded or summed back.
"""
from ... import kernels
from ...backend import is_device_array, matmul
from ..function import Function
from .arithmetic import unbroadcast


class MatMul(Function):
    """a @ b with NumPy's rules: 1-D operands are promoted, leading dimensions broadcast."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        ga = gb = None
        if a.ndim == 1 and b.ndim == 1:                 # dot product: g is a scalar
            return (g * b if need[0] else None), (g * a if need[1] else None)
        if a.ndim == 1:                                 # (n) @ (..., n, m) -> (..., m)
            if need[0]:
                ga = unbroadcast(matmul(g[..., None, :], b.swapaxes(-1, -2))[..., 0, :], a.shape)
            if need[1]:
                gb = a[:, None] * g[..., None, :]
            return ga, gb
        if b.ndim == 1:                                 # (..., n, k) @ (k) -> (..., n)
            if need[0]:
                ga = g[..., None] * b
            if need[1]:
                gb = unbroadcast(matmul(a.swapaxes(-1, -2), g[..., None])[..., 0], b.shape)
            return ga, gb
        if need[0]:
            ga = unbroadcast(matmul(g, b.swapaxes(-1, -2)), a.shape)
        if need[1]:
            if b.ndim == 2 and a.ndim > 2:              # (..., n, k) @ (k, m): fold the batch into rows
                gb = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            else:
                gb = unbroadcast(matmul(a.swapaxes(-1, -2), g), b.shape)
        return ga, gb


def matmul_rows(x, w):
    """x (..., k) @ w (k, n) as one (rows, k) @ (k, n) product. On the GPU this is one cuBLAS GEMM
    (CuPy reads a transposed w in place); CuPy's matmul of a 3-D x would copy w to contiguous memory
    and run a batched GEMM per call. (The CPU keeps NumPy's matmul, and its exact results.)"""
    if not is_device_array(x) or x.ndim == 2:
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[-1],))


class Linear(Function):
    """y = x @ W.T + b with W of shape (out, in), as torch.nn.functional.linear. One graph node
    for the whole layer keeps per-op overhead low."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        out = matmul_rows(x, weight.T)
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = matmul_rows(g, weight) if need[0] else None
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if need[1] else None
        gb = kernels.sum_leading(g2, 1) if len(need) > 2 and need[2] else None
        return gx, gw, gb

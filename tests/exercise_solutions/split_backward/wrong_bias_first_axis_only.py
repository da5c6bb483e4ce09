"""The bias gradient summed over the first axis only: right for x (rows, in), wrong for (batch, seq, in)."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight, (grad_y, x)


def backward_w(deferred):
    grad_y, x = deferred
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return g.T @ x.reshape(-1, x.shape[-1]), grad_y.sum(axis=0)

EXPECT = ['x (2, 3, 5), weight (4, 5): grad_bias: shape (3, 4), expected (4,)', 'summed over the first axis only']

"""The weight gradient as one product per batch element: the batch axis is never summed."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight, (grad_y, x)


def backward_w(deferred):
    grad_y, x = deferred
    return grad_y.swapaxes(-1, -2) @ x, grad_y.reshape(-1, grad_y.shape[-1]).sum(axis=0)

EXPECT = ['grad_weight: shape (2, 4, 5), expected (4, 5)', 'fold every leading dimension into rows']

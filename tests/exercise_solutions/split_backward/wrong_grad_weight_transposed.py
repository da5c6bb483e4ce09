"""W returns x.T @ grad_y, (in, out): the weight is (out, in)."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight, (grad_y, x)


def backward_w(deferred):
    grad_y, x = deferred
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return x.reshape(-1, x.shape[-1]).T @ g, g.sum(axis=0)

EXPECT = ['grad_weight: element (0, 1)', 'it is transposed']

"""The halves the wrong way round: B computes the weights' gradients and defers the input gradient."""


def backward_b(grad_y, x, weight):
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return None, (grad_y, weight, g.T @ x.reshape(-1, x.shape[-1]), g.sum(axis=0))


def backward_w(deferred):
    grad_y, weight, grad_weight, grad_bias = deferred
    return grad_weight, grad_bias

EXPECT = ['grad_x is None', 'B returns the input gradient at once']

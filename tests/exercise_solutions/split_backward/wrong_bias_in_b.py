"""The bias gradient summed in B: a weight's gradient, which nobody waits for."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight, (grad_y, x, grad_y.reshape(-1, grad_y.shape[-1]).sum(axis=0))


def backward_w(deferred):
    grad_y, x, grad_bias = deferred
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return g.T @ x.reshape(-1, x.shape[-1]), grad_bias

EXPECT = ['B ran add.reduce on grad_y', 'that is the bias gradient']

"""W computes the input gradient again (and drops it): the weight kept until W, work done twice."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight, (grad_y, x, weight)


def backward_w(deferred):
    grad_y, x, weight = deferred
    grad_y @ weight                       # the input gradient once more, for nothing
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return g.T @ x.reshape(-1, x.shape[-1]), g.sum(axis=0)

EXPECT = ['W ran matmul on the weight', 'W needs only grad_y and x']

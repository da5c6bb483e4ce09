"""B multiplies by weight.T: y = x @ weight.T, so grad_x is grad_y @ weight."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight.T, (grad_y, x)


def backward_w(deferred):
    grad_y, x = deferred
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return g.T @ x.reshape(-1, x.shape[-1]), g.sum(axis=0)

EXPECT = ['x (6, 4), weight (4, 4): grad_x: element (0, 0)', 'you multiplied by weight.T']

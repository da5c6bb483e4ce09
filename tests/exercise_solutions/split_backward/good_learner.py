"""A learner's split backward, written from the contract: B keeps (grad_y, x) and returns grad_y @ weight;
W folds the leading dimensions into rows."""


def backward_b(grad_y, x, weight):
    return grad_y @ weight, (grad_y, x)


def backward_w(deferred):
    grad_y, x = deferred
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return g.T @ x.reshape(-1, x.shape[-1]), g.sum(axis=0)

"""Every gradient computed in B, W only hands them out: right values, but the weight gradient sits on the
critical path and nothing is left to fill the bubble."""


def backward_b(grad_y, x, weight):
    g = grad_y.reshape(-1, grad_y.shape[-1])
    return grad_y @ weight, (g.T @ x.reshape(-1, x.shape[-1]), g.sum(axis=0))


def backward_w(deferred):
    return deferred

EXPECT = ['B ran matmul on x', "the weight gradient (grad_y.T @ x) is W's work"]

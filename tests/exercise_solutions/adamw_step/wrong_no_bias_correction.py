"""Steps with the raw moments: at the first step exp_avg is (1 - beta1) * grad, ten times too small."""


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    param *= 1 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1 - beta1) * grad
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * grad * grad
    param -= lr * exp_avg / (exp_avg_sq ** 0.5 + eps)

EXPECT = ['param: element (0, 0) is 0.157227', 'without their bias correction']
